"""The seventh red-team pass: what the code costs the host's kernel beyond its limits (its log, shared pages, NUMA
placement) and what killed pools leave in the host's cgroups. Each test asserts what the host sees."""

from __future__ import annotations

import re
import subprocess

import pytest
from prime_core.config.sandbox import SandboxLimits

from tests.sandbox.conftest import MAX_CONCURRENCY, UID_BASE, assert_serving, run, uid_span

pytestmark = pytest.mark.xdist_group("sandbox")

# Children that each allocate under RLIMIT_AS but together past the memory cgroup, re-forked as the kernel kills them
OOM_FLOOD = """
import os, time
kids = set()
while True:
    while len(kids) < 4:
        pid = os.fork()
        if pid == 0:
            try:
                b = bytearray(90 << 20)
                time.sleep(30)
            finally:
                os._exit(0)
        kids.add(pid)
    pid, _ = os.wait()
    kids.discard(pid)
"""


def kernel_oom_kills(span: range) -> int:
    """OOM kills the host's kernel log reports of processes of uids in ``span`` (one full report each)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("the kernel log is not readable here")
    return sum(int(uid) in span for uid in re.findall(r"Killed process \d+ .*UID:(\d+)", log))


def test_host_kernel_log_one_execution_past_its_memory_prints_at_most_one_oom_report(sandbox):
    # Each OOM kill printed a full report (~20 lines) into the host's kernel log: an execution re-forking children
    # that each allocate printed 955 lines in 5 s, for its whole wall limit, in every slot at once.
    span = uid_span(UID_BASE, MAX_CONCURRENCY)
    limits = SandboxLimits(wall_s=4, cpu_s=20, memory_mb=128)
    before = kernel_oom_kills(span)
    results = [run(sandbox, OOM_FLOOD, limits=limits) for _ in range(2)]
    reports = kernel_oom_kills(span) - before
    if sandbox.pool._cgroups is None:
        pytest.skip("no memory cgroup on this host")
    assert [r.status for r in results] == ["memory_limit"] * 2, results
    assert [r.reason for r in results] == ["memory limit of 128 MB exceeded"] * 2
    assert reports <= 2, f"{reports} OOM kills reported in the host's kernel log for 2 executions"
    assert_serving(sandbox)
