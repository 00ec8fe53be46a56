"""What the code can still reach across its namespaces: each attack goes in through the public API and the test
asserts what the host sees (a host process's state, the neighbour's result), never only that nothing raised."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest

from tests.sandbox import attacks
from tests.sandbox.conftest import FAST, assert_serving, own_pool, run

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


def _slot_memory_mb(pool, key: str) -> float:
    cgroups = pool._cgroups
    if cgroups.version == 1:
        return int((cgroups.parents["memory"] / key / "memory.usage_in_bytes").read_text()) / (1 << 20)
    return int((cgroups.parents[""] / key / "memory.current").read_text()) / (1 << 20)


def test_neighbours_descriptors_left_in_flight_do_not_outlive_the_execution():
    # A cycle of unix sockets in flight holding a /work file and full pipes outlived its execution: 76 MiB stayed
    # charged to the slot (so taken from the next execution in it) until something on the host happened to close a
    # unix socket, 0.3 s to over 20 s later on the test VM. The supervisor now closes one after the reap.
    with own_pool(uid_base=4_300_000, max_concurrency=1) as client:
        if client.pool._cgroups is None:
            pytest.skip("no memory cgroup on this host")
        result = client.execute_sync(ExecRequest(code=attacks.IN_FLIGHT_CYCLE, limits=FAST))
        assert result.status == "ok" and "in flight 35" in result.stdout, result
        deadline = time.monotonic() + 0.2
        while (left := _slot_memory_mb(client.pool, "s0")) > 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert left <= 8, f"{left:.0f} MiB still charged to the slot after the execution ended"


def test_kernel_no_capability_in_any_namespace_the_execution_is_in(sandbox):
    # The filter lets these calls through: only a capability (over the network namespace its supervisor made, or
    # over the host) would make them do anything.
    if not attacks.X86_64:
        pytest.skip("x86_64 syscall numbers")
    result = run(sandbox, attacks.CAPABILITY_PROBES)
    assert result.status == "ok", result
    probes = dict(line.split() for line in result.stdout.splitlines())
    assert set(probes) == {
        "raw_socket", "loopback_up", "rcvbufforce", "ioprio_realtime", "mknod_char", "trusted_xattr", "chown_root",
        "setuid_root",
    }, probes  # fmt: skip
    assert all(int(code) < 0 for code in probes.values()), probes


def test_neighbours_pipes_grown_by_the_code_leave_the_neighbours_theirs(sandbox):
    # The supervisor made each execution's pipes as its own uid, shared by every execution: 20 executions growing
    # stdout, stderr and the test channel to 1 MiB took 15,360 of its 16,384 pages (fs.pipe-user-pages-soft), the
    # next ones were refused (EPERM), and executions started then got pipes of 8 KiB instead of 64 KiB.
    if int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text()) != 16384:
        pytest.skip("the test is sized for the default fs.pipe-user-pages-soft")
    limits = SandboxLimits(wall_s=20, cpu_s=20)

    async def together():
        grow = ExecRequest(code=attacks.GROW_PIPES.format(hold=2), limits=limits)
        growing = [asyncio.ensure_future(sandbox.execute(grow)) for _ in range(24)]
        await asyncio.sleep(1.5)
        probes = await asyncio.gather(*(sandbox.execute(ExecRequest(code=attacks.PIPE_SIZES)) for _ in range(16)))
        return await asyncio.gather(*growing), probes

    grown, probes = sandbox.call(together()).result(timeout=120)
    assert {(r.status, r.stdout) for r in grown} == {("ok", "1048576 1048576 1048576\n")}, grown
    assert {(r.status, r.stdout) for r in probes} == {("ok", "65536 65536 65536\n")}, probes


def test_neighbours_no_core_scheduling_cookie(sandbox):
    # On an SMT host with core scheduling (CONFIG_SCHED_CORE, as Ubuntu's kernels), a cookie of its own made the
    # code's core run nothing else on its sibling thread while the code ran: a whole core for one CPU's charge, the
    # trainer's threads off it. This VM has neither (the call answered EINVAL, not EPERM): the filter refuses it.
    result = run(sandbox, attacks.SCHED_CORE)
    assert result.status == "ok", result
    probes = dict(line.split() for line in result.stdout.splitlines())
    assert probes["sched_core_create"] == probes["sched_core_create_high_bits"] == "-1", probes  # EPERM
    assert (probes["set_name"], probes["get_dumpable"], probes["set_pdeathsig"]) == ("0", "0", "0"), probes
