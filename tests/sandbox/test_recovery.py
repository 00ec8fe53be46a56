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

from tests.sandbox.conftest import SESSION_UIDS, assert_no_sandbox_processes, own_pool, uid_span

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
        assert_no_sandbox_processes(span=range(SESSION_UIDS + 364_001, uid_span(SESSION_UIDS + 364_000, 8).stop))


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


def test_inside_a_run_the_pool_reports_progress_and_a_stuck_pool_is_named(tmp_path, monkeypatch):
    """With ``PRIME_PROGRESS_DIR`` (a process of a run) the pool writes its counters and running executions once a
    second. A pool whose loop stops while an execution runs (here: blocked on purpose, its bound cut to 1 s) is named
    by the orchestrator's env watch at the bound and by the launcher's watchdog ``slack_s`` later; closed, it leaves
    no file."""

    from prime_core.config.liveness import LivenessConfig
    from prime_core.progress import read_progress
    from prime_launch.watchdog import ProcessStuck, Watchdog
    from prime_orchestrator.env_watch import HangWatch
    from prime_orchestrator.sandbox.liveness import PoolProgress

    monkeypatch.setenv("PRIME_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("PRIME_RUN_ID", "run")
    path = tmp_path / f"sandbox_pool_{os.getpid()}.json"
    with own_pool(uid_base=368_000, hang_timeout_s=HANG_S, start_timeout_s=5) as client:
        assert client.execute_sync(ExecRequest(code="print(1)")).status == "ok"
        time.sleep(1.5)
        idle = read_progress(path)
        assert idle.process == "sandbox_pool" and idle.pid == os.getpid() and idle.run_id == "run"
        assert idle.counters["executions_completed"] == 1 and idle.counters["zygotes"] == 1 and idle.activities == []
        assert (
            PoolProgress(client.pool.config, client.pool.health, 30).bound_s() == 2 * (5 + HANG_S + 10) + 10 + 30 + 10
        )
        monkeypatch.setattr(PoolProgress, "bound_s", lambda self: 1.0)

        async def block(seconds: float) -> None:
            time.sleep(seconds)  # the pool's loop stops: the verdict that arrives is never read

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            running = ex.submit(client.execute_sync, ExecRequest(code="import time\ntime.sleep(1)\nprint(2)"))
            time.sleep(0.3)
            blocked = client.call(block(7.0))
            dog = Watchdog(LivenessConfig(slack_s=2.5), run_id="run")
            dog.watch_helpers(tmp_path)
            watch = HangWatch("code", type("Proc", (), {"pid": os.getpid()})(), None, 5.0, set)
            start, named_at, stuck = time.monotonic(), None, None
            while stuck is None and time.monotonic() - start < 6.5:
                named_at = named_at or (watch.stuck_pool() and time.monotonic() - start)
                dog._last_check = 0.0
                try:
                    dog.check()
                except ProcessStuck as e:
                    stuck = (e, time.monotonic() - start)
                time.sleep(0.2)
            blocked.result(timeout=30)
            assert running.result(timeout=30).stdout == "2\n"
        reason = watch.stuck_pool() if named_at is None else "named"
        assert named_at is not None and 0.5 < named_at < 4, (named_at, reason)
        assert stuck is not None, "the watchdog did not name the pool"
        error, took = stuck
        print(f"pool loop blocked: env watch at {named_at:.1f} s (bound 1 s), watchdog at {took:.1f} s: {error.cause}")
        assert 2.5 < took < 6.5, took
        assert error.cause.startswith("sandbox pool is stuck: the sandbox pool (pid ")
        assert "has been running 1 sandbox execution(s) for" in error.cause and "+ 2 s slack" in error.cause
        assert "1 executions completed, 0 zygotes replaced" in error.cause
        time.sleep(1.5)
        assert read_progress(path).activities == []
    assert not path.exists()


def test_code_that_stops_itself_does_not_get_its_env_server_replaced(sandbox):
    """The env watch kills any process of an env server stopped by a signal, but not a sandbox's: an execution that
    sends itself SIGSTOP ends at its wall limit, and its neighbours on the same worker never notice."""
    from prime_orchestrator.env_watch import HangWatch
    from prime_orchestrator.proc_tree import ZYGOTE_MARK, family, process_tree
    from prime_orchestrator.sandbox.zygotes import _BOOT

    assert ZYGOTE_MARK.decode() in _BOOT
    # PID 1 of the execution's namespace ignores SIGSTOP from inside; a child it forks does not.
    code = (
        "import os, signal\nif os.fork() == 0:\n    os.kill(os.getpid(), signal.SIGSTOP)\nos.wait()\nprint('resumed')"
    )
    limits = SandboxLimits(wall_s=3, processes=4)
    running = sandbox.call(sandbox.pool.execute(ExecRequest(code=code, limits=limits)))
    deadline = time.monotonic() + 10
    while "T" not in process_tree(os.getpid()).values():
        assert time.monotonic() < deadline, "the execution never stopped itself"
        time.sleep(0.05)
    watch = HangWatch("code", type("Proc", (), {"pid": os.getpid()})(), None, 5.0, set)
    states = {pid: state for pid, (_, state) in family(os.getpid(), without_sandboxes=True).items()}
    assert "T" not in states.values() and watch.stopped(states) is None
    result = running.result(timeout=30)
    assert result.status == "timeout" and result.stdout == "", result
