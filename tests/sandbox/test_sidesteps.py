"""A reward-hacking policy sidestepping the limits that are set per process, or reaching what the sandbox binds in,
beyond ``test_attacks.py``, ``test_redteam.py`` and ``test_containment.py``: each attack goes in through the public
API and the test asserts what the host sees (the status, the CPU the trusted supervisor counted, the files listed)."""

from __future__ import annotations

import os

import pytest
from prime_core.config.sandbox import SandboxLimits

from tests.sandbox.conftest import assert_no_sandbox_processes, assert_serving, run

pytestmark = pytest.mark.xdist_group("sandbox")

# limits: RLIMIT_CPU bounds each process alone. Each child burns 0.8 s (under the 1 s limit) and hands on to the next,
# in a chain or {width} at a time; the parent prints the CPU they spent, and waits for all or lets the kernel reap them.
CPU_HANDOFF = """
import os, signal, time
if not {wait}:  # reaped by the kernel: their CPU never reaches the runner's rusage
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
def burn():
    t = time.process_time()
    while time.process_time() - t < 0.8:
        pass
spent, (r, w) = 0.0, os.pipe()
for _ in range(8):
    pids = []
    for _ in range({width}):
        pid = os.fork()
        if pid == 0:
            burn()
            os.write(w, b"x")
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        spent += 0.8 * len(os.read(r, 1))
        if {wait}:
            os.waitpid(pid, 0)
print("spent", spent)
"""


@pytest.mark.parametrize(("width", "wait"), [(1, True), (2, True), (2, False)], ids=["chain", "pairs", "orphans"])
def test_limits_cpu_time_counts_every_process_together(sandbox, width, wait):
    # Before: a chain of children each under RLIMIT_CPU spent 6.4 s of CPU in an execution limited to 1 s, which
    # ended "ok" (the orphans' CPU was not even in the reported cpu_s, which counted what the runner reaped).
    if sandbox.pool._cgroups is None or not getattr(sandbox.pool._cgroups, "counts_cpu", True):
        pytest.skip("no cgroup CPU counter on this host: the total is not enforced (the pool says so)")
    limits = SandboxLimits(wall_s=60, cpu_s=1)
    result = run(sandbox, CPU_HANDOFF.format(width=width, wait=wait), limits=limits)
    assert result.status == "timeout" and "CPU time limit of 1.0 s exceeded" in result.reason, result
    cpus = len(os.sched_getaffinity(0))
    assert 1.0 <= result.cpu_s <= 1.05 + 0.005 * cpus + 0.1, result.cpu_s  # the budget, one read late at most
    assert_no_sandbox_processes(grace_s=2)
    within = run(sandbox, CPU_HANDOFF.replace("range(8)", "range(1)").format(width=1, wait=True), limits=limits)
    assert (within.status, within.stdout) == ("ok", "spent 0.8\n"), within  # under the budget: untouched
    assert_serving(sandbox)


@pytest.mark.parametrize(
    ("counter", "seconds"),
    [(b"usage_usec 1500000\nuser_usec 1000000\n", 1.5), (b"2000000000\n", 2.0)],
    ids=["v2", "v1"],
)
def test_limits_the_cpu_counter_of_either_cgroup_version_reads_as_seconds(tmp_path, counter, seconds):
    from prime_orchestrator.sandbox.supervisor import CpuClock

    path = tmp_path / "counter"
    path.write_bytes(b"0\n" if counter[:1].isdigit() else b"usage_usec 0\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        clock = CpuClock(fd, cpu_s=1.5)
        path.write_bytes(counter)
        assert (clock.used(), clock.budget) == (seconds, 2 + CpuClock.GRACE_S)
    finally:
        os.close(fd)
