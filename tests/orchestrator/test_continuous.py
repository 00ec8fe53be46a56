"""Continuous rollouts (``max_off_policy_steps``): the staleness bound cancels and drops exactly the groups it should
(a scripted stand-in for the orchestrator, where the test decides when each group finishes and which weight step
sampled its first token), and the whole loop against the real torch engine with in-flight weight updates ships every
step within the bound, with exact versions, and resumes without training an example twice."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.io import remove_published
from prime_core.monitor import read_metrics
from prime_core.run_dir import RunDir
from prime_core.schemas.rollout import PolicyVersions, RolloutResult
from prime_orchestrator.batch import Rollout
from prime_orchestrator.concurrency import AdaptiveController, ConcurrencyLimiter
from prime_orchestrator.continuous import Continuous

from tests.orchestrator.conftest import TorchServer, publish_weights
from tests.orchestrator.test_integration import make_config, run


class Policy:
    def __init__(self):
        self.version = 0
        self.listeners = []

    def serve(self, version: int) -> None:
        self.version = version
        for listener in self.listeners:
            listener()

    async def wait_for(self, version: int, timeout: float) -> float:
        while self.version < version:
            await asyncio.sleep(0.005)
        return 0.0


class Ledger:
    """The servers' version records as the stand-in keeps them: a started rollout sampled its first token at once."""

    def __init__(self):
        self.first: dict[str, int] = {}
        self.aborted: list[str] = []

    async def peek(self, flights):
        return {f.tag: PolicyVersions(first=self.first[f.tag], last=self.first[f.tag]) for f in flights}

    async def abort(self, flights):
        self.aborted += [f.tag for f in flights]


class Passthrough:
    async def track(self, step, rollout):
        return await rollout

    async def score(self, step, env, rollouts):
        return rollouts


class ScriptedOrchestrator:
    """What `Continuous` uses of the orchestrator; a group's rollouts end when the test calls ``finish``."""

    def __init__(self, **overrides):
        self.config = OrchestratorConfig.model_validate(
            {"batch_size": 4, "rollouts_per_example": 2, "async_level": 1, "max_off_policy_steps": 1,
             "max_steps": 3, **overrides}
        )  # fmt: skip
        self.start_step = 0
        self.envs = {e.resolved_name: e for e in self.config.env}
        self.cursors = dict.fromkeys(self.envs, 0)
        self.cursor_history: dict[int, dict[str, int]] = {}
        self.policy, self.versions, self.tracker = Policy(), Ledger(), Passthrough()
        self.semaphore = ConcurrencyLimiter(1024)  # fixed: no staleness cap (tests/orchestrator/test_staleness_cap.py)
        self.teachers = self.tracker
        self.done: dict[int, asyncio.Event] = {}
        self.firsts: dict[int, int] = {}
        self.cont: Continuous | None = None

    async def _rollout(self, step, env, example, group, index, flight) -> Rollout:
        draw = next(r.draw for r in self.cont.running.values() if any(f is flight for f in r.flights))
        async with self.semaphore:
            flight.started, flight.tag, flight.url = self.policy.version, f"d{draw}-{index}", "server"
            self.versions.first[flight.tag] = self.policy.version
            await self.done.setdefault(draw, asyncio.Event()).wait()
        result = RolloutResult(env=env, example=example, reward=1.0 * index, completion_len=3)
        result.versions = flight.versions = PolicyVersions(first=self.firsts[draw], last=self.policy.version)
        return Rollout(env, example, group, flight.started, result)

    def finish(self, *draws: int, first: int) -> None:
        """End these groups now (in this order, in one event-loop turn), their first tokens sampled at ``first``."""
        for draw in draws:
            self.firsts[draw] = first
            self.done.setdefault(draw, asyncio.Event()).set()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


def test_batches_take_the_oldest_groups_and_wait_for_last_chance_ones():
    async def main():
        orch = ScriptedOrchestrator()
        cont = orch.cont = Continuous(orch)
        buffer: asyncio.Queue = asyncio.Queue()
        loop = asyncio.create_task(cont.rollout_loop(buffer))

        async def batch():
            return await (await asyncio.wait_for(buffer.get(), 10))

        await settle()
        # Weights 0 serve batches 0 and 1 (async_level 1): two batches' worth of groups run, no more.
        assert sorted(cont.running) == [0, 1, 2, 3]
        orch.finish(2, 3, first=0)  # out of order: 2 and 3 finish first and form batch 0
        b0 = await batch()
        assert [g[0].example for g in b0.groups] == [2, 3] and b0.metrics["off_policy/dropped"] == 0
        orch.finish(0, first=0)
        await settle()
        orch.policy.serve(1)  # the trainer published weights 1: groups for batch 2 may start
        await settle()
        assert sorted(cont.running) == [1, 4, 5]
        # 4 and 5 (first token on weights 1) finish before group 1 (weights 0). Batch 1 still waits for group 1: at
        # step 2 its staleness would be 2 > 1, while 4 and 5 may train at step 2.
        orch.finish(4, 5, first=1)
        await settle()
        assert buffer.empty() and [r.draw for r in cont.ready] == [4, 5]
        orch.finish(1, first=0)
        b1 = await batch()
        assert [g[0].example for g in b1.groups] == [0, 1]
        b2 = await batch()
        assert [g[0].example for g in b2.groups] == [4, 5]
        assert await asyncio.wait_for(buffer.get(), 10) is None
        for b in (b0, b1, b2):  # staleness = trainer step - version of the first token, never above the bound
            assert all(b.step - r.result.versions.first <= 1 for g in b.groups for r in g)
            assert b.metrics["off_policy/dropped"] == 0
        assert orch.versions.aborted == [] and orch.cursor_history[3] == {"reverse-text": 6}
        await loop

    asyncio.run(main())


def test_the_bound_cancels_running_and_drops_queued_groups_exactly():
    """What the formation never lets happen when versions are consistent (the dispatch budget leaves room for every
    group in a batch within the bound), the sweep still enforces: here the test says that the groups went out on
    weights older than those served."""

    async def main():
        orch = ScriptedOrchestrator(max_steps=4)
        orch.semaphore = ConcurrencyLimiter(64, controller=AdaptiveController(ceiling=64, target_kv_usage=0.9))
        cont = orch.cont = Continuous(orch)
        orch.policy.version, cont.fill_step = 2, 3
        queued, running, fresh = (cont.start_group() for _ in range(3))
        await settle()
        orch.finish(queued.draw, first=1)
        await settle()
        assert list(cont.ready) == [queued]
        for f in running.flights:  # went out on weights 1, and the record says the first tokens came from them
            f.started = orch.versions.first[f.tag] = 1
        await cont.sweep()
        assert orch.versions.aborted == [f.tag for f in running.flights]
        assert cont.counts == {"in_flight": 2, "in_queue": 2, "dropped": 2}
        assert list(cont.ready) == [] and list(cont.running) == [fresh.draw]
        # Their examples are drawn again (once), on the weights served then.
        assert list(cont.redraw) == [("reverse-text", queued.example, 1), ("reverse-text", running.example, 1)]
        # The next batch's formation moves the staleness cap: drops since the previous batch cut it.
        metrics = cont.steer_concurrency([])
        assert metrics["concurrency/peak_in_flight"] == 6 and cont.cap.value == 4  # 0.75 x the 6 in flight
        await settle()
        assert orch.semaphore.limit == 4 and orch.semaphore.in_flight == 2  # the fresh group's (the rest cancelled)
        fresh.task.cancel()

    asyncio.run(main())


def test_a_group_whose_first_token_is_recent_enough_is_kept():
    """The bound counts from the first token: a group that started long ago but sampled its first token on newer
    weights (it waited for a slot) is not stale."""

    async def main():
        orch = ScriptedOrchestrator(max_off_policy_steps=2, async_level=1, max_steps=2)
        cont = orch.cont = Continuous(orch)
        assert cont.stale(0, 3) and not cont.stale(1, 3) and not cont.stale(None, 99)
        run = cont.start_group()
        await settle()
        orch.versions.first.update({f.tag: 2 for f in run.flights})  # the record: first tokens on weights 2
        assert await cont.stale_running(4) == []
        orch.versions.first.update({run.flights[0].tag: 1})
        assert await cont.stale_running(4) == [run]
        run.task.cancel()

    asyncio.run(main())


def test_a_failing_group_ends_the_run():
    async def main():
        orch = ScriptedOrchestrator()
        cont = orch.cont = Continuous(orch)

        async def broken(*args, **kwargs):
            raise RuntimeError("teacher server gone")

        orch.teachers = type("T", (), {"score": staticmethod(broken)})()
        loop = asyncio.create_task(cont.rollout_loop(asyncio.Queue()))
        await settle()
        orch.finish(0, first=0)
        with pytest.raises(RuntimeError, match="teacher server gone"):
            await asyncio.wait_for(loop, 10)

    asyncio.run(main())


@pytest.fixture(scope="module")
def in_flight_server(tiny_model):
    pytest.importorskip("prime_inference.server")
    s = TorchServer(tiny_model, weight_update="in_flight")
    yield s
    s.stop()


def fake_trainer(root, model, steps: int, first: int = 0, seconds: float = 0.5, hold=None) -> threading.Thread:
    """Consume rollouts/step_n, then publish weights n + 1, as the trainer does (``hold(n + 1)`` first, if given)."""

    def train():
        for n in range(first, steps):
            path = root / "rollouts" / f"step_{n}" / "rank_0.safetensors"
            while not path.exists():
                time.sleep(0.02)
            time.sleep(seconds)
            if hold is not None:
                hold(n + 1)
            publish_weights(root, n + 1, model)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread


def shipped_examples(root, step: int) -> set[int]:
    rows = (root / "samples" / f"orchestrator_step_{step}.jsonl").read_text().splitlines()
    return {json.loads(r)["example"] for r in rows}


@pytest.mark.integration
def test_continuous_loop_ships_every_step_within_the_bound_and_resumes(tmp_path, tiny_model, in_flight_server):
    steps, k = 4, 1
    overrides = dict(max_steps=steps, async_level=1, max_off_policy_steps=k, num_trainer_ranks=1,
                     ckpt={"interval": 2}, log_extras={"interval": 1, "num_samples": 64})  # fmt: skip
    config = make_config(tmp_path, tiny_model, in_flight_server, **overrides)
    trainer = fake_trainer(tmp_path, tiny_model, steps)
    run(config)
    trainer.join(60)
    records = [r.values for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")]
    assert [r["samples/trained"] for r in records] == [4] * steps  # every step shipped, full
    for m in records:
        assert m["off_policy/max"] <= k and m["off_policy_lag/max"] <= k
        # The tag went through verifiers to the server, whose record of each rollout is exact.
        assert m["policy/versions_exact"] == 1.0
        assert {"off_policy/in_flight", "off_policy/in_queue", "off_policy/dropped"} <= set(m)
    progress = json.loads((tmp_path / "checkpoints" / "step_2" / "orchestrator" / "progress.json").read_text())
    assert progress["step"] == 2
    before = shipped_examples(tmp_path, 0) | shipped_examples(tmp_path, 1)
    assert max(before) < progress["cursors"]["reverse-text"]

    # Resume from the checkpoint of step 2: nothing shipped before it is trained again, the cursor goes on.
    (tmp_path / "samples").rename(tmp_path / "samples_first_run")
    resumed = make_config(tmp_path, tiny_model, in_flight_server, **{**overrides, "ckpt": {"resume_step": 2}})
    # As `rl --resume` does: the first run's weights 3, 4 go (left there, the orchestrator refuses to start on them).
    for step in (3, 4):
        remove_published(RunDir(tmp_path).weight_step(step))
    trainer = fake_trainer(tmp_path, tiny_model, steps, first=2)  # weights 3, 4 are written again; 2 is there
    run(resumed)
    trainer.join(60)
    after = shipped_examples(tmp_path, 2) | shipped_examples(tmp_path, 3)
    assert not after & before and min(after) >= progress["cursors"]["reverse-text"]


def test_the_dispatcher_ends_with_the_loop_even_when_its_cancel_is_swallowed():
    """Python 3.11's wait_for returns instead of raising when the cancel meets a wake-up that just happened: the
    dispatcher must still end (one that lived on held the process's asyncio.run exit forever; it did before)."""

    async def main():
        orch = ScriptedOrchestrator()
        cont = orch.cont = Continuous(orch)
        cont.dispatcher = asyncio.create_task(cont.dispatch_loop())
        await settle()
        cont.changed.set()
        await asyncio.sleep(0)  # the wake-up's inner wait completes; the dispatcher has not resumed yet
        cont.dispatcher.cancel()
        done, _ = await asyncio.wait({cont.dispatcher}, timeout=2)
        assert done == {cont.dispatcher}
        for group in cont.running.values():
            group.task.cancel()

    asyncio.run(main())
