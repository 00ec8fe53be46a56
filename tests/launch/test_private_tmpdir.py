"""Every process rl starts has a private TMPDIR, removed once the processes are gone however they ended.

benchmarks/chaos.py: a process rl had to SIGKILL (its main thread stuck in C past SIGTERM's grace) runs no exit
handler, and left its multiprocessing forkserver directory (``/tmp/pymp-*``) in the shared temp dir, one per trial.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from prime_launch.process import ProcessManager, ProcessSpec

# Starts a forkserver (its pymp-* directory), says where it is, then ignores SIGTERM as a process stuck in C would.
CHILD = r"""
import multiprocessing as mp, signal, time
from multiprocessing import util
ctx = mp.get_context("forkserver")
p = ctx.Process(target=time.sleep, args=(0,))
p.start(); p.join()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(util.get_temp_dir(), flush=True)
time.sleep(120)
"""


@pytest.fixture
def temp(monkeypatch):
    """The temp dir rl and its children see: a short one (pytest's own leaves no room for a Unix socket's path)."""
    path = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("how", ["sigkill_after_grace", "launcher_killed"])
def test_a_child_that_must_be_sigkilled_leaves_nothing_in_the_temp_dir(tmp_path, temp, how):
    manager = ProcessManager(grace_s=0.5, run_id="r1")
    log = tmp_path / "child.log"
    proc = manager.start(ProcessSpec("orchestrator", [sys.executable, "-c", CHILD], log))
    deadline = time.monotonic() + 60
    while not log.read_text().strip() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pymp = Path(log.read_text().strip())
    assert pymp.is_dir() and pymp.name.startswith("pymp-"), log.read_text()
    assert pymp.parent == manager.temp_root / "orchestrator" and manager.temp_root.name.startswith("prime-r1-")
    if how == "sigkill_after_grace":
        took = manager.stop_all()
        manager.close()
        assert proc.returncode == -signal.SIGKILL and took >= 0.5
    else:  # rl itself killed (-9): its watchdog stops the children and removes their temp dirs
        watchdog = manager._watchdog
        watchdog.stdin.close()
        watchdog.wait(timeout=30)
        proc.wait(timeout=10)
        manager._watchdog = None
    assert list(temp.iterdir()) == []


def test_a_temp_dir_too_deep_for_sockets_is_left_as_it_is(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    manager = ProcessManager(watchdog=False)
    assert manager._private_temp_dir("orchestrator") is None and not deep.exists()


def test_compile_caches_stay_where_they_are_without_a_private_temp_dir(tmp_path, temp, monkeypatch):
    """torch inductor's and FlashAttention-4's caches default to the temp dir: a child's private TMPDIR would move
    them into a directory removed after the run (compiled again every run)."""
    import torch._inductor.runtime.cache_dir_utils as inductor

    for name in ("TORCHINDUCTOR_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    manager = ProcessManager(watchdog=False, run_id="r2")
    log = tmp_path / "env.log"
    show = "import os; print(os.environ['TMPDIR'], os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['FLASH_ATTENTION_CUTE_DSL_CACHE_DIR'])"
    manager.start(ProcessSpec("trainer", [sys.executable, "-c", show], log)).wait(timeout=60)
    manager.stop_all()
    manager.close()
    private, inductor_dir, fa4_dir = log.read_text().split()
    assert Path(private).parent == manager.temp_root
    assert inductor_dir == inductor.default_cache_dir()  # as the launcher, with the shared temp dir, sees it
    assert Path(fa4_dir).parent.parent == temp  # FA4's <temp>/<user>/flash_attention_cute_dsl_cache
