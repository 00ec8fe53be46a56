"""The pool's own recovery (issue #38): a zygote that dies or hangs is found within a bound and replaced, what it
was running ends as a clear ``sandbox_error`` (never a hang), what it never forked runs on the replacement, and
the pool's counters tell a launcher so."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest

from tests.sandbox.conftest import assert_no_sandbox_processes, own_pool, uid_span

pytestmark = pytest.mark.xdist_group("sandbox")
HANG_S = 2.0


def test_a_hung_zygote_is_replaced_within_its_bound():
    with own_pool(uid_base=364_000, hang_timeout_s=HANG_S) as client:
        pool = client.pool
        assert client.execute_sync(ExecRequest(code="print(1)")).status == "ok"
        before = pool.health()
        zygote = pool._zygotes[0].proc.pid
        long = ExecRequest(code="import time\ntime.sleep(30)\nprint('late')", limits=SandboxLimits(wall_s=60))
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            running = ex.submit(client.execute_sync, long)
            time.sleep(0.5)  # forked: its supervisor runs on while the zygote is stopped
            os.kill(zygote, signal.SIGSTOP)
            start = time.monotonic()
            queued = client.execute_sync(ExecRequest(code="print('after')"))
            took = time.monotonic() - start
            died = running.result(timeout=30)
        assert (queued.status, queued.stdout) == ("ok", "after\n"), queued  # never forked: run on the replacement
        assert HANG_S <= took < HANG_S + 10, took
        assert died.status == "sandbox_error" and "died" in died.reason, died
        after = pool.health()
        assert after.zygotes_replaced == before.zygotes_replaced + 1
        assert after.zygotes_started == before.zygotes_started + 1 and after.zygotes == 1
        assert after.executions_completed == before.executions_completed + 1
        assert after.sandbox_errors == before.sandbox_errors + 1
        assert pool._zygotes[0].proc.pid != zygote
        assert_no_sandbox_processes(span=range(364_001, uid_span(364_000, 8).stop))


def test_a_dead_zygote_is_replaced_and_counted(sandbox):
    pool = sandbox.pool
    before = pool.health()
    slow = ExecRequest(code="import time\ntime.sleep(30)", limits=SandboxLimits(wall_s=60))
    running = sandbox.call(pool.execute(slow))
    time.sleep(0.5)
    os.kill(pool._zygotes[0].proc.pid, signal.SIGKILL)
    start = time.monotonic()
    died = running.result(timeout=20)
    assert died.status == "sandbox_error" and "died during the execution" in died.reason, died
    assert time.monotonic() - start < 10
    assert sandbox.execute_sync(ExecRequest(code="print(2)")).stdout == "2\n"
    after = pool.health()
    assert after.zygotes_replaced == before.zygotes_replaced + 1 and after.zygotes == 1
    assert after.executions_completed == before.executions_completed + 1
    assert_no_sandbox_processes()


def test_health_counts_progress(sandbox):
    before = sandbox.pool.health()
    for _ in range(3):
        sandbox.execute_sync(ExecRequest(code="print(1)"))
    after = sandbox.pool.health()
    assert after.executions_completed == before.executions_completed + 3
    assert after.executions_started == before.executions_started + 3
    assert after.running == 0 and after.quarantined == 0


def test_the_pool_says_what_it_cannot_enforce_and_still_holds_memory(caplog):
    import logging

    from prime_core.config.sandbox import SandboxLimits as Limits

    from tests.sandbox import attacks

    limits = Limits(memory_mb=64, disk_mb=16)
    with (
        caplog.at_level(logging.WARNING, logger="prime_orchestrator.sandbox.pool"),
        own_pool(uid_base=366_000, cgroups=False) as client,
    ):
        health = client.pool.health()
        hoard = client.execute_sync(ExecRequest(code=attacks.MEMFD_HOARD, limits=limits))
    assert len(health.unenforced) == 1 and "cgroup" in health.unenforced[0], health.unenforced
    assert any("not enforced on this host" in r.getMessage() for r in caplog.records)
    # Without cgroups the filter still refuses the memory no rlimit counts.
    assert hoard.status == "error" and "Operation not permitted" in hoard.reason, hoard
    assert hoard.memory_peak_mb is None
