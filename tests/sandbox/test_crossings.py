"""What the code can still reach across its namespaces: each attack goes in through the public API and the test
asserts what the host sees (a host process's state, the neighbour's result), never only that nothing raised."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.sandbox.conftest import assert_serving, run

pytestmark = pytest.mark.xdist_group("sandbox")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_neighbours_no_signal_reaches_the_pools_process_group(sandbox):
    # kill(0, sig) signals the caller's process group, wherever its members are: the runner was in the pool's (the
    # zygote's), outside its PID namespace, and SIGCONT passes for any process of the same session. A host process
    # of that group stopped by its operator (or a zygote the pool's hang test stops) was resumed from inside.
    host = subprocess.Popen(["sleep", "30"])  # in this process's group, as the pool's zygote is
    try:
        host.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(host.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        result = run(sandbox, "import os, signal\nos.kill(0, signal.SIGCONT)\nos.killpg(0, signal.SIGCONT)\n")
        assert result.status == "ok", result
        time.sleep(0.1)
        assert _state(host.pid) == "T", "a host process outside the sandbox was resumed from inside"
    finally:
        host.kill()
        host.wait()
    assert_serving(sandbox)
