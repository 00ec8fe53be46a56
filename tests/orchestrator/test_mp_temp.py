"""An orchestrator or ``eval`` started by hand (no launcher to remove its TMPDIR) that is SIGKILLed leaves its
forkserver's directory only until the next one starts: that one removes every directory whose owner is gone, and
never a live process's."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Owns its multiprocessing temp dir, starts a forkserver in it, says where, then waits to be killed.
OWNER = r"""
import multiprocessing as mp, time
from prime_orchestrator.mp_temp import own_temp_dir
own_temp_dir()
ctx = mp.get_context("forkserver")
p = ctx.Process(target=time.sleep, args=(0,))
p.start(); p.join()
from multiprocessing import util
print(util.get_temp_dir(), flush=True)
time.sleep(120)
"""


@pytest.fixture
def temp(monkeypatch):
    path = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: a Unix socket's path has at most 107 bytes
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_owner() -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_sigkilled_owners_directory_goes_with_the_next_process_and_a_live_ones_stays(temp):
    from prime_orchestrator.mp_temp import LOCK, remove_orphans

    killed, killed_dir = start_owner()
    live, live_dir = start_owner()
    try:
        assert killed_dir.parent == live_dir.parent == temp and (killed_dir / LOCK).is_file()
        stranger = temp / "pymp-stranger"  # another program's (no lock file): never ours to remove
        stranger.mkdir()
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        deadline = time.monotonic() + 10  # its forkserver notices the parent is gone and exits
        while killed_dir.exists() and time.monotonic() < deadline:
            if remove_orphans(temp):
                break
            time.sleep(0.05)
        assert sorted(temp.iterdir()) == sorted([live_dir, stranger])
    finally:
        live.kill()
        killed.kill()
        live.wait(timeout=10)
