"""The orchestrator's liveness pieces alone: screening rollouts, the share of good rollouts a step needs, the progress
lane of rollouts in flight, and finding hung env-server processes (end to end: tests/faults/test_env_faults.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.progress import ProgressReporter
from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
from prime_orchestrator import liveness
from prime_orchestrator.env_watch import HangWatch, process_tree
from prime_orchestrator.liveness import RolloutsFailed, RolloutTracker, check_step, screen


def ok(env="a", reward=1.0, **kw) -> RolloutResult:
    seq = TrainedSequence(token_ids=[1, 2], loss_mask=[False, True], logprobs=[0.0, -0.5])
    return RolloutResult(env=env, example=0, traces=[TraceResult(reward=reward, sequences=[seq])], reward=reward, **kw)


def failed(env="a", error="TimeoutError: timed out after 600s") -> RolloutResult:
    return RolloutResult(env=env, example=0, failed=True, error=error)


def test_a_reward_or_metric_that_is_not_finite_fails_the_rollout():
    bad = screen(ok(reward=float("nan")), 1000)
    assert bad.failed and bad.error == "not finite: reward = nan" and bad.sequences == []
    # A seat's reward (a multi-agent env's) is what its advantages are taken over, the rollout's mean finite or not.
    seats = [TraceResult(seat="white", reward=1.0), TraceResult(seat="black", reward=float("-inf"))]
    bad = screen(RolloutResult(env="duel", example=0, traces=seats, reward=0.0), 1000)
    assert bad.failed and bad.error == "not finite: reward of seat black = -inf"
    assert screen(ok(metrics={"len": float("inf")}), 1000).error == "not finite: len = inf"
    assert not screen(ok(metrics={"len": 3.0}), 1000).failed


def test_enormous_text_is_cut_for_the_log_tables():
    big = screen(ok(prompt="p" * 5000, completion="c" * 10), 1024)
    assert big.prompt == "p" * 1024 + "... [3976 more characters]" and big.completion == "c" * 10
    assert big.sequences == ok().sequences


def test_a_step_stops_the_run_when_too_few_rollouts_succeed():
    check_step(3, [ok(), ok(), failed(), failed()], 0.5)
    check_step(3, [], 0.5)
    with pytest.raises(RolloutsFailed) as e:
        check_step(3, [ok(), failed("b", "KeyError: 'x'"), failed("a"), failed("b")], 0.5)
    assert str(e.value) == (
        "step 3: 3 of 4 rollouts failed (b: 2, a: 1), more than orchestrator.recovery.min_ok_fraction = 0.5 allows; "
        "first error: KeyError: 'x'"
    )


def test_tracker_shows_rollouts_in_flight_and_counts_failures(tmp_path, monkeypatch):
    reporter = ProgressReporter(tmp_path / "o.json", "orchestrator")
    monkeypatch.setattr(liveness.progress, "_current", reporter)
    config = OrchestratorConfig.model_validate({"env": [{"id": "reverse-text", "rollout_timeout": 40}]})
    tracker = RolloutTracker(config)
    release = asyncio.Event()

    async def rollout(result):
        await release.wait()
        return tracker.record(result)

    async def main():
        tasks = [asyncio.create_task(tracker.track(s, rollout(r))) for s, r in [(0, ok()), (0, failed()), (1, ok())]]
        await asyncio.sleep(0.01)
        (lane,) = reporter.snapshot().activities
        assert lane.lane == "rollouts" and lane.limit_s == 40 + config.recovery.probe_timeout_s
        assert lane.what == "generating rollouts (0 of 2 done for step 0, 0 of 1 done for step 1)"
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    snapshot = reporter.snapshot()
    assert snapshot.activities == [] and snapshot.counters == {"rollouts/a/done": 3, "rollouts/a/failed": 1}


def test_a_lane_keeps_its_clock_while_work_joins_and_restarts_it_when_work_ends(tmp_path, monkeypatch):
    """More in flight is no progress: only a finished request restarts the lane's clock (eval rollouts, teachers)."""
    reporter = ProgressReporter(tmp_path / "o.json", "orchestrator")
    monkeypatch.setattr(liveness.progress, "_current", reporter)
    lane = liveness.InflightLane("evals", "generating eval rollouts", 70.0)
    first, second = asyncio.Event(), asyncio.Event()

    async def main():
        a = asyncio.create_task(lane.track(first.wait()))
        await asyncio.sleep(0.01)
        (begun,) = reporter.snapshot().activities
        b = asyncio.create_task(lane.track(second.wait()))
        await asyncio.sleep(0.01)
        (joined,) = reporter.snapshot().activities
        assert joined.since == begun.since and joined.limit_s == 70.0 and joined.lane == "evals"
        assert joined.what == "generating eval rollouts (0 of 2 done)"
        first.set()
        await a
        (touched,) = reporter.snapshot().activities
        assert touched.since > begun.since and touched.what == "generating eval rollouts (1 of 2 done)"
        second.set()
        await b

    asyncio.run(main())
    assert reporter.snapshot().activities == []


class _Proc:
    def __init__(self, popen):
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self):
        return self.popen.poll() is None

    def kill(self):
        self.popen.kill()


def test_a_stopped_process_of_an_env_server_is_killed_and_named():
    server = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(server.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        child = max(p for p in process_tree(server.pid) if p != server.pid)
        os.kill(child, signal.SIGSTOP)
        while process_tree(server.pid).get(child) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        watch = HangWatch("tool-env", _Proc(server), None, 30, set)
        reason = watch.stopped()
        assert reason == f"pid {child} (sleep 60) was stopped by a signal and would never resume; killed it"
        while child in process_tree(server.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child not in process_tree(server.pid) and watch.stopped() is None
    finally:
        server.kill()
        server.wait()


class _SilentClient:
    async def health(self, timeout):
        await asyncio.sleep(0.01)
        return False


def test_a_server_that_answers_no_health_probe_is_replaced():
    server = subprocess.Popen(["sleep", "60"])
    try:
        watch = HangWatch("reverse-text", _Proc(server), _SilentClient(), 0.3, set)
        liveness_probe = asyncio.run(_probe_twice(watch))
        assert liveness_probe[0] is None
        assert liveness_probe[1].startswith(f"the server pid {server.pid} did not answer a health probe for ")
        assert "(its event loop is blocked: a reward function or tool call that never returns?)" in liveness_probe[1]
    finally:
        server.kill()
        server.wait()


class _BusyClient:
    """A worker whose event loop is busy, not blocked: it answers every health request, 2.5 s late."""

    def __init__(self):
        self.asked = 0

    async def health(self, timeout):
        self.asked += 1
        await asyncio.sleep(min(2.5, timeout))
        return timeout >= 2.5


def test_a_busy_worker_that_answers_late_is_not_replaced():
    """One worker with 512 rollouts in flight answers health seconds late (each pass of its loop runs hundreds of
    callbacks). Each probe waited 2 s for its answer, so every probe read as silence and the worker was killed with
    all its rollouts after ``probe_timeout_s``. A probe now waits as long as silence may last."""
    server = subprocess.Popen(["sleep", "60"])
    client = _BusyClient()

    async def watch_for(seconds: float) -> list[str | None]:
        watch = HangWatch("reverse-text", _Proc(server), client, 4.0, set)
        verdicts, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            verdicts.append(await watch.unanswered())
            await asyncio.sleep(0.5)
        await watch.close()
        return verdicts

    try:
        verdicts = asyncio.run(watch_for(8.0))
        assert verdicts and all(v is None for v in verdicts), verdicts
        assert 3 <= client.asked <= 5  # one request in flight at a time, each answered
    finally:
        server.kill()
        server.wait()


async def _probe_twice(watch: HangWatch):
    first = await watch.unanswered()
    await asyncio.sleep(0.4)
    return first, await watch.unanswered()


BLOCKED_WORKER = """
import asyncio, os, sys, time
from prime_orchestrator.stacks import register_stack_dump

def reward_that_never_returns():
    time.sleep(3600)

async def main():
    register_stack_dump()
    print("ready", flush=True)
    await asyncio.sleep(0.1)
    reward_that_never_returns()

asyncio.run(main())
"""


def test_a_blocked_worker_is_named_by_the_function_its_loop_is_stuck_in(tmp_path, monkeypatch):
    """The line that says why a silent worker was replaced named no culprit ("a reward function or tool call that
    never returns?"); it names the function the worker's event loop is blocked in, from the worker's own stack."""
    import sys

    monkeypatch.setenv("PRIME_PROGRESS_DIR", str(tmp_path))
    worker = subprocess.Popen([sys.executable, "-c", BLOCKED_WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "ready\n"
        time.sleep(0.5)  # into the blocking call
        watch = HangWatch("arithmetic", _Proc(worker), _SilentClient(), 0.3, set)
        first, reason = asyncio.run(_probe_twice(watch))
        assert first is None and reason.startswith(f"the server pid {worker.pid} did not answer a health probe for ")
        assert reason.endswith(
            "(its event loop is blocked in reward_that_never_returns (<string>:6), called from main (<string>:12))"
        ), reason
        assert worker.poll() is None and not (tmp_path / f"env_stack_{worker.pid}.txt").exists()
    finally:
        worker.kill()
        worker.wait()


def test_the_stack_summary_names_the_innermost_frame_and_the_env_function_verifiers_called():
    from prime_orchestrator.stacks import summarize

    dump = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/site-packages/sympy/core/power.py", line 340 in __new__
  File "/repo/environments/arithmetic/src/arithmetic/data.py", line 64 in score_answer
  File "/repo/environments/arithmetic/src/arithmetic/taskset.py", line 22 in correct
  File "/venv/site-packages/verifiers/v1/utils/invoke.py", line 40 in invoke
  File "/venv/site-packages/verifiers/v1/task.py", line 264 in score
  File "/usr/lib/python3.11/asyncio/base_events.py", line 1922 in _run_once
  File "/usr/lib/python3.11/asyncio/base_events.py", line 607 in run_forever
"""
    assert summarize(dump) == "__new__ (core/power.py:340), called from correct (arithmetic/taskset.py:22)"
    assert summarize("") is None and summarize(dump.split("Current")[0]) is None


def test_a_pool_file_an_earlier_run_left_under_a_reused_pid_is_not_this_runs_stuck_pool(tmp_path, monkeypatch):
    """progress/ (kept by a resume) held an earlier run's ``sandbox_pool_<pid>.json`` whose pid a process of this
    run's env server now has: its old overdue activity had that process killed as a stuck pool."""
    from prime_core.progress import helper_file
    from prime_core.schemas.progress import Activity, Progress

    monkeypatch.setenv("PRIME_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("PRIME_RUN_ID", "now")
    server = subprocess.Popen(["sleep", "60"])
    try:
        overdue = Activity(lane="executions", what="running 1 sandbox execution(s)", since=0.0, limit_s=5)
        for run_id, named in (("earlier", False), (None, False), ("now", True)):
            record = Progress(process="sandbox_pool", pid=server.pid, run_id=run_id, started=0.0, time=1.0,
                              activities=[overdue])  # fmt: skip
            helper_file("sandbox_pool", server.pid).write_text(record.model_dump_json())
            reason = HangWatch("code", _Proc(server), None, 30, set).stuck_pool({server.pid: "S"})
            assert (reason is not None) == named, (run_id, reason)
    finally:
        server.kill()
        server.wait()


class _Worker:
    """A pool worker's client: answers health (``ok``) or not; counts its close."""

    closed = 0

    def __init__(self, address: str):
        self.ok = not address.endswith("silent")

    async def health(self, timeout):
        return self.ok

    async def close(self):
        _Worker.closed += 1


def test_the_hang_watch_forgets_workers_that_left_and_a_reused_pid_inherits_nothing(monkeypatch):
    """``HangWatch`` kept a client and a last answer for every worker pid it ever probed: over a long run of worker
    restarts they added up (1,000 departed workers: 1,000 clients, none closed). And a pid reused by a new worker
    inherited the old one's client (a socket nobody listens on) and its silence: it was killed at once."""
    import verifiers.v1.serve.client
    from prime_orchestrator import env_watch

    workers: dict[int, str] = {}
    monkeypatch.setattr(env_watch, "listening_paths", lambda pids: {p: workers[p] for p in pids})
    monkeypatch.setattr(verifiers.v1.serve.client, "EnvClient", _Worker)
    monkeypatch.setattr(_Worker, "closed", 0)
    watch = HangWatch("pool", type("Proc", (), {"pid": os.getpid()})(), None, 0.3, lambda: set(workers))

    async def go():
        for pid in range(10_000, 11_000):  # one worker at a time, each replaced by the next
            workers.clear()
            workers[pid] = f"/tmp/w{pid}"
            assert await watch.unanswered() is None
        sizes = (len(watch._clients), len(watch._last_ok), len(watch._probes))
        workers.clear()
        workers[5] = "/tmp/w5-silent"  # silent, then gone; a new worker gets its pid
        assert await watch.unanswered() is None
        await asyncio.sleep(0.4)
        workers[5] = "/tmp/w5-new"
        reused = await watch.unanswered()
        await watch.close()
        return sizes, reused

    sizes, reused = asyncio.run(go())
    assert sizes == (1, 1, 1) and _Worker.closed == 1_002, (sizes, _Worker.closed)
    assert reused is None


def test_the_tool_watch_forgets_servers_that_left_and_a_reused_pid_inherits_nothing(monkeypatch):
    """``ToolWatch`` kept every shared tool server it ever saw: one whose worker left too was never dropped (1,000
    worker restarts: 1,000 entries, each looked for at every probe). And a pid reused by another process of the tree
    kept the old server's port: probed there, it was named silent and the env server replaced."""
    from prime_orchestrator import tool_watch
    from prime_orchestrator.tool_watch import ToolWatch

    servers: dict[int, int] = {}  # pid -> port of the tool servers of the tree
    monkeypatch.setattr(tool_watch, "shared_tool_server", lambda pid: (pid in servers, servers.get(pid)))
    monkeypatch.setattr(tool_watch, "command", lambda pid: "python -m calc")
    monkeypatch.setattr(tool_watch, "http_answers", lambda port, timeout: asyncio.sleep(0, port != 7007))
    watch = ToolWatch(probe_timeout_s=0.3, probe_every_s=0.1)
    for worker in range(20_000, 22_000, 2):  # a worker and its tool server, then both gone with the next worker
        servers.clear()
        servers[worker + 1] = worker
        assert watch.gone({1: (0, "S"), worker: (1, "S"), worker + 1: (worker, "S")}) is None
    assert (len(watch._servers), len(watch._ports), len(watch._kind)) == (1, 1, 3)
    servers.clear()
    servers[7] = 7007  # a server that stops answering, then leaves with its worker 6
    assert watch.gone({1: (0, "S"), 6: (1, "S"), 7: (6, "S")}) is None
    assert asyncio.run(watch.silent()) is None
    assert watch.gone({1: (0, "S"), 3: (1, "S")}) is None
    time.sleep(0.4)
    servers.clear()  # pid 7 again: a plain child of worker 3, not a tool server
    assert watch.gone({1: (0, "S"), 3: (1, "S"), 7: (3, "S")}) is None
    assert asyncio.run(watch.silent()) is None
    # A tool server whose pid shows up under another parent between two looks exited: its worker still lives.
    servers[9] = 9009
    assert watch.gone({1: (0, "S"), 3: (1, "S"), 4: (1, "S"), 9: (3, "S")}) is None
    servers.pop(9)
    reason = watch.gone({1: (0, "S"), 3: (1, "S"), 4: (1, "S"), 9: (4, "S")})
    assert reason == "tool server pid 9 (python -m calc) on port 9009 exited; its worker pid 3 cannot start another"
