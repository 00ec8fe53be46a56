"""An orchestrator stopped by SIGTERM (how ``rl`` and schedulers stop it) leaves no ``$TMPDIR/pymp-*`` behind: the
env servers' forkserver keeps its socket in multiprocessing's temporary directory, which only an exit handler
removed, and SIGTERM ran none. Each test gives the child a private TMPDIR, so other processes' directories do not
count."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(what: str, done, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the process exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.1)


@pytest.fixture
def short_tmp():
    """A private TMPDIR with a short path: the forkserver's socket (``<TMPDIR>/pymp-*/listener-*``) may have at most
    107 bytes, and a pytest path under an xdist worker (``.../popen-gw1/test_an_orchestrator_stopped_b0/tmp``) made
    108: the orchestrator failed to start its env server (AF_UNIX path too long) under ``-n 2`` only."""
    path = Path(tempfile.mkdtemp(prefix="sigterm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_removes_the_forkservers_temp_dir(short_tmp):
    tmp_path = short_tmp
    code = (
        "import multiprocessing.util, sys, time\n"
        "from prime_orchestrator.env_server import server_context\n"
        "server_context()\n"
        "print(multiprocessing.util.get_temp_dir(), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True
    )
    made = Path(proc.stdout.readline().strip())
    assert made.parent == tmp_path and made.name.startswith("pymp-") and made.is_dir()
    assert _stop(proc) == -signal.SIGTERM  # still ended by the signal, at once
    assert list(tmp_path.glob("pymp-*")) == []


def test_a_tmpdir_too_long_for_the_forkservers_socket_is_one_line(short_tmp):
    long_tmp = short_tmp / ("x" * (100 - len(str(short_tmp))))
    long_tmp.mkdir()
    code = (
        "from prime_orchestrator.env_server import server_context\n"
        "ctx = server_context()\n"
        "ctx.Process(target=print).start()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(long_tmp)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and last.startswith(
        "prime_orchestrator.env_server.EnvServerFailed: TMPDIR is too long"
    )
    assert f"{long_tmp}/pymp-" in last and "at most 107 fit; set a shorter TMPDIR" in last, last


@pytest.mark.slow
def test_an_orchestrator_stopped_by_sigterm_leaves_no_temp_dir(tmp_path, short_tmp):
    tmp = short_tmp
    (tmp_path / "o.toml").write_text(
        f'output_dir = "{tmp_path / "run"}"\nmax_steps = 2\nbatch_size = 4\nrollouts_per_example = 2\n'
        f'[model]\nname = "{ROOT / "examples/reverse_text/model"}"\n'
        '[client]\nbase_urls = ["http://127.0.0.1:9/v1"]\nhealth_timeout = 300\n'  # inference never comes up
        '[[env]]\nid = "reverse-text"\n'
    )
    orchestrator = Path(sys.executable).parent / "orchestrator"
    log = tmp_path / "run/logs/orchestrator.log"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [str(orchestrator), "@", str(tmp_path / "o.toml")], env={**os.environ, "TMPDIR": str(tmp)}, stderr=err
        )
    try:
        _wait_for("env server up", lambda: log.is_file() and "env server reverse-text up" in log.read_text(), proc, 240)
        assert [p.name[:5] for p in tmp.glob("pymp-*")] == ["pymp-"]
    finally:
        code = _stop(proc)
    assert code == -signal.SIGTERM
    assert list(tmp.glob("pymp-*")) == []
