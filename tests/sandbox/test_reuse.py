"""What the pool does to a slot between two executions: the processes it kills (only the slot's, even when their pids
were reused) and the memory it waits for before lending the slot again."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import leases as leases_mod
from prime_orchestrator.sandbox.leases import SETTLE_S, Lease, Leases
from prime_orchestrator.sandbox.pool import _Job
from prime_orchestrator.sandbox.schemas import ExecRequest
from prime_orchestrator.sandbox.zygotes import ResultPipe

from tests.sandbox import attacks
from tests.sandbox.conftest import FAST, SESSION_UIDS, own_pool

pytestmark = pytest.mark.xdist_group("sandbox")


class _StaleListing:
    """A slot's cgroup whose listing named ``pid`` once: by the time the reaper signals it, that process has exited
    and ``pid`` belongs to a host process (here the test's ``sleep``, standing for the one a wrap of pid_max gave it)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.calls = pid, 0

    def pids(self, key: str) -> list[int]:
        self.calls += 1
        return [self.pid] if self.calls == 1 else []


def _host_process() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"])


def test_the_reaper_never_signals_a_pid_reused_after_its_listing(monkeypatch):
    # The reaper read cgroup.procs (or scanned /proc for the uid) and then os.kill()ed each pid: a pid that exited in
    # between, its number reused, killed an unrelated process. Now each is signalled through a pidfd, and only if the
    # slot still lists it once the pidfd is open.
    victims = [_host_process(), _host_process()]
    try:
        asyncio.run(
            Leases(1, SESSION_UIDS + 4_400_000, _StaleListing(victims[0].pid))._reap("s0", SESSION_UIDS + 4_400_001)
        )
        calls = iter([[victims[1].pid]])
        monkeypatch.setattr(leases_mod, "processes_of", lambda uid: next(calls, []))
        asyncio.run(
            Leases(1, SESSION_UIDS + 4_400_000, None)._reap("s0", SESSION_UIDS + 4_400_001)
        )  # without cgroups: by uid (root's is 0)
        assert [v.poll() for v in victims] == [None, None], "the reaper killed a host process that got a slot's pid"
    finally:
        for v in victims:
            v.kill()
            v.wait()


def test_the_reaper_still_kills_what_the_slot_lists():
    left = _host_process()  # stands for a process of the slot: listed for as long as it lives

    class Listing:
        def pids(self, key: str) -> list[int]:
            return [left.pid] if left.poll() is None else []

    try:
        asyncio.run(
            asyncio.wait_for(Leases(1, SESSION_UIDS + 4_400_000, Listing())._reap("s0", SESSION_UIDS + 4_400_001), 10)
        )
        assert left.wait(timeout=5) == -9
    finally:
        left.kill()
        left.wait()


async def _kill_supervisor_after(pid: int, supervisor_gone: bool) -> None:
    r, w = os.pipe()
    job = _Job(ExecRequest(code=""), SandboxLimits(), Lease(0, 1, "s0"))
    job.pipe = ResultPipe(r)
    os.write(w, b"+%d\n" % pid)  # the zygote forked a supervisor with this pid
    if supervisor_gone:  # ... which exited before the pool read its acknowledgement: the pid may be anyone's now
        os.close(w)
    while job.pipe.supervisor is None:
        await asyncio.sleep(0.001)
    job.kill_supervisor()
    job.pipe.close()
    if not supervisor_gone:
        os.close(w)


def test_a_supervisor_is_killed_through_its_pidfd_never_by_a_reused_pid():
    # kill_supervisor() os.kill()ed the pid the supervisor wrote when forked; the zygote reaps its supervisors at
    # once, so after the supervisor exited that number could be any process's.
    victim, supervisor = _host_process(), _host_process()
    try:
        asyncio.run(_kill_supervisor_after(victim.pid, supervisor_gone=True))
        asyncio.run(_kill_supervisor_after(supervisor.pid, supervisor_gone=False))
        assert supervisor.wait(timeout=5) == -9, "a live supervisor is still killed"
        assert victim.poll() is None, "a process that got an exited supervisor's pid was killed"
    finally:
        for p in (victim, supervisor):
            p.kill()
            p.wait()


def test_a_slot_is_lent_again_only_once_what_its_last_execution_left_is_freed():
    # Descriptors left in flight (a /work file and full pipes, 65 MiB) are freed by the kernel's unix GC tens of ms
    # after the verdict, and the slot was lent at once: the next execution in it started with them charged to its
    # memory cgroup (its memory_peak_mb read 64-100 MiB for a print; with a workload near its limit, an OOM kill).
    # Now the pool waits (at most SETTLE_S) until the slot's charge is back near empty before lending it.
    with own_pool(uid_base=4_300_000, max_concurrency=1) as client:
        if client.pool._cgroups is None or client.pool._cgroups.version != 1:
            pytest.skip("a v1 memory cgroup (its resettable peak) is what this test reads")
        peaks = []
        for _ in range(3):
            attack = client.execute_sync(ExecRequest(code=attacks.IN_FLIGHT_CYCLE, limits=FAST))
            assert attack.status == "ok" and "in flight 35" in attack.stdout, attack
            after = client.execute_sync(ExecRequest(code="print(1)", limits=FAST))
            assert after.status == "ok", after
            peaks.append(after.memory_peak_mb)
        assert max(peaks) < 8, f"the next execution in the slot was charged {peaks} MiB at its peak"


def test_what_never_goes_holds_a_slot_once_for_the_bound_then_is_its_floor(caplog):
    # Memory that neither the GC nor a reclaim frees stays charged: the slot waits SETTLE_S for it once, says so,
    # and later executions wait only for what they add to it.
    class Held:
        charge = 100 << 20

        def left_over(self, key: str, small: int) -> int:
            return self.charge

        def reclaim(self, key: str, nbytes: int) -> None:
            pass

    leases = Leases(1, SESSION_UIDS + 4_400_000, Held())
    lease = Lease(0, SESSION_UIDS + 4_400_001, "s0")
    waits = []
    for charge in (100 << 20, 102 << 20, 0):
        leases.cgroups.charge = charge
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="prime_orchestrator.sandbox.leases"):
            asyncio.run(leases.settle(lease))
        waits.append(time.monotonic() - started)
    assert SETTLE_S <= waits[0] < SETTLE_S + 0.3 and max(waits[1:]) < 0.05, waits
    assert "100 MiB left charged" in caplog.text and leases._floor["s0"] == 0
