"""Continuous rollouts and the rollouts in flight: the staleness cap (`prime_orchestrator.concurrency.StalenessCap`)
backs off when rollouts are dropped as stale and grows back without drops; the limiter applies it to adaptive
concurrency only; formation takes the oldest groups first and keeps slots for last-chance groups until the trainer
needs the batch; and, against a simulated engine whose decode steps the rollouts in flight share, the cap stops the
drops that a high concurrency would cause, with no drops in the steady state."""

from __future__ import annotations

import asyncio

import pytest
from prime_core.schemas.rollout import PolicyVersions, RolloutResult
from prime_orchestrator.batch import Rollout
from prime_orchestrator.concurrency import AdaptiveController, ConcurrencyLimiter, EngineLoad, StalenessCap
from prime_orchestrator.continuous import Continuous, GroupRun
from prime_orchestrator.versions import Flight

from tests.orchestrator.test_continuous import Policy, ScriptedOrchestrator


def test_the_cap_backs_off_on_drops_to_the_safe_count_and_grows_back():
    # The H100 long-tail record: 512 rollouts of ~213 tokens a batch, the longest 1024.
    cap = StalenessCap(ceiling=1024, bound=1, batch_size=512, group_size=8)
    assert cap.update(dropped=0, peak_in_flight=1024, batch_tokens=109_000, longest=1024) == 1024
    assert cap.safe == 106  # 1 x 109,000 / 1024: even the longest trains within one step at this count
    cuts = [cap.update(dropped=304, peak_in_flight=min(cap.value, 1024), batch_tokens=109_000, longest=1024)
            for _ in range(9)]  # fmt: skip
    assert cuts == [768, 576, 432, 324, 243, 182, 136, 106, 106]  # x 0.75 each, never below the safe count
    assert cap.update(dropped=0, peak_in_flight=106, batch_tokens=109_000, longest=1024) == 106 + 64  # + 1/8 batch
    # The cut starts from what was in flight (what caused the drops), not from a cap that nothing reached.
    assert cap.update(dropped=8, peak_in_flight=120, batch_tokens=109_000, longest=1024) == 106
    two = StalenessCap(ceiling=1024, bound=2, batch_size=512, group_size=8)
    two.update(dropped=8, peak_in_flight=1024, batch_tokens=109_000, longest=1024)
    assert two.safe == 212 and two.value == 768
    # The longest of the last few batches counts: one short batch does not lift the safe count.
    two.update(dropped=0, peak_in_flight=768, batch_tokens=109_000, longest=200)
    assert two.safe == 212


def test_the_limiter_applies_the_cap_to_adaptive_concurrency_only():
    controller = AdaptiveController(ceiling=1024, target_kv_usage=0.9)
    adaptive = ConcurrencyLimiter(800, controller=controller)
    adaptive.set_cap(600)
    assert adaptive.limit == 600 and adaptive.metrics()["concurrency/staleness_cap"] == 600
    roomy = EngineLoad(kv_cache_usage=0.1, waiting=0, preemptions=0, new_preemptions=0)
    assert controller.update(600, roomy, in_flight=600, queued=50, cap=600) == 600  # no growth past the cap
    assert controller.update(600, roomy, in_flight=600, queued=50, cap=1000) == 900  # grows again once it rises
    fixed = ConcurrencyLimiter(512)
    fixed.set_cap(100)
    assert fixed.limit == 512 and fixed.cap is None  # a fixed count is the user's


def test_the_peak_in_flight_is_read_per_period():
    async def main():
        limiter = ConcurrencyLimiter(8)
        gate = asyncio.Event()

        async def rollout():
            async with limiter:
                await gate.wait()

        tasks = [asyncio.create_task(rollout()) for _ in range(5)]
        await asyncio.sleep(0.01)
        assert limiter.take_peak() == 5
        gate.set()
        await asyncio.gather(*tasks)
        assert limiter.take_peak() == 5 and limiter.take_peak() == 0  # the next period starts at what is in flight

    asyncio.run(main())


def finished(draw: int, first: int) -> GroupRun:
    run = GroupRun(draw, "reverse-text", draw, [Flight(started=first), Flight(started=first)])
    result = RolloutResult(env="reverse-text", example=draw, versions=PolicyVersions(first=first, last=first))
    run.rollouts = [Rollout("reverse-text", draw, 0, first, result)]
    return run


def test_formation_takes_the_oldest_first_and_keeps_slots_for_last_chance_groups():
    orch = ScriptedOrchestrator(max_off_policy_steps=2, async_level=1, max_steps=4)
    cont = Continuous(orch)
    orch.policy.version = 1
    a, b, c = finished(0, first=1), finished(1, first=1), finished(2, first=0)
    cont.ready.extend([a, b])
    running = GroupRun(3, "reverse-text", 3, [Flight(started=0), Flight()])  # started on weights 0: step 2 or never
    cont.running[3] = running
    # Batch 2 has two slots; one is held for the running last-chance group: a takes the other, b (it may still train
    # at step 3) waits.
    assert cont.next_ready(2, taken=0) is a
    assert cont.next_ready(2, taken=1) is None
    cont.ready.append(c)  # a last-chance group that finished after b is taken before it
    assert cont.next_ready(2, taken=1) is c
    del cont.running[3]  # nothing last-chance runs any more: the oldest ready group, then completion order
    cont.ready.extend([finished(4, first=0), finished(5, first=1)])
    assert [cont.next_ready(2, taken=0).draw for _ in range(3)] == [4, 1, 5]


# ----- a simulated engine -----


class SimEngine:
    """Decode steps that the rollouts in flight share: each tick the engine samples ``rate`` tokens spread over them,
    at most ``per_rollout`` each (a rollout's own latency bound). A group's first rollout is ``long`` tokens when its
    draw is even (the tail), every other rollout ``short``."""

    def __init__(self, rate: float, per_rollout: float, short: int = 8, long: int = 64):
        self.rate, self.per_rollout, self.short, self.long = rate, per_rollout, short, long
        self.active: dict[str, list] = {}  # tag -> [tokens left, first version, done event]

    def length(self, draw: int, index: int) -> int:
        return self.long if draw % 2 == 0 and index % 4 == 0 else self.short

    def tick(self, version: int) -> None:
        if not self.active:
            return
        each = min(self.per_rollout, self.rate / len(self.active))
        for entry in list(self.active.values()):
            entry[1] = version if entry[1] is None else entry[1]
            entry[0] -= each
            if entry[0] <= 0:
                entry[2].set()


class TickPolicy(Policy):
    """Waits on the weights themselves, not on the wall clock: the simulation's time is its ticks."""

    async def wait_for(self, version: int, timeout: float) -> float:
        while self.version < version:
            changed = asyncio.Event()
            self.listeners.append(changed.set)
            await changed.wait()
            self.listeners.remove(changed.set)
        return 0.0


class SimOrchestrator(ScriptedOrchestrator):
    def __init__(self, engine: SimEngine, **overrides):
        super().__init__(**overrides)
        self.engine, self.policy = engine, TickPolicy()
        self.semaphore = ConcurrencyLimiter(
            self.config.client.initial_concurrent,
            controller=AdaptiveController(ceiling=self.config.client.max_concurrent, target_kv_usage=0.9),
        )
        self.versions = self  # peek / abort read the engine's records

    async def _rollout(self, step, env, example, group, index, flight) -> Rollout:
        draw = next(r.draw for r in self.cont.running.values() if any(f is flight for f in r.flights))
        async with self.semaphore:
            flight.started, flight.tag, flight.url = self.policy.version, f"d{draw}-{index}", "server"
            n = self.engine.length(draw, index)
            entry = self.engine.active[flight.tag] = [n, None, asyncio.Event()]
            try:
                await entry[2].wait()
            finally:
                self.engine.active.pop(flight.tag, None)
        result = RolloutResult(env=env, example=example, reward=float(index % 2), completion_len=n)
        result.versions = flight.versions = PolicyVersions(first=entry[1], last=self.policy.version)
        return Rollout(env, example, group, flight.started, result)

    async def peek(self, flights):
        firsts = {f.tag: self.engine.active[f.tag][1] for f in flights if f.tag in self.engine.active}
        return {tag: PolicyVersions(first=v, last=v) for tag, v in firsts.items() if v is not None}

    async def abort(self, flights):
        pass  # the cancelled tasks leave the engine themselves


async def simulate(engine: SimEngine, *, steps: int, trainer_ticks: int, **overrides) -> list[dict]:
    """Run the continuous loop against the engine, one tick per event-loop round; the trainer takes each batch and
    publishes the next weights ``trainer_ticks`` ticks later. The limiter sees a roomy KV cache: only the staleness cap
    holds the count in flight back. Returns each batch's metrics, the tick it was taken at and its tokens."""
    orch = SimOrchestrator(engine, max_steps=steps, **overrides)
    cont = orch.cont = Continuous(orch)
    roomy = EngineLoad(kv_cache_usage=0.01, waiting=0, preemptions=0, new_preemptions=0)
    buffer: asyncio.Queue = asyncio.Queue()
    loop = asyncio.create_task(cont.rollout_loop(buffer))
    batches: list[dict] = []
    training_until = None
    for tick in range(200 * steps):
        for _ in range(5):
            await asyncio.sleep(0)
        engine.tick(orch.policy.version)
        limiter = orch.semaphore
        limiter.set_limit(limiter.controller.update(limiter.limit, roomy, in_flight=limiter.in_flight,
                                                    queued=limiter.queued, cap=limiter.cap))  # fmt: skip
        if training_until is not None:
            training_until -= 1
            if training_until == 0:
                orch.policy.serve(len(batches))
                training_until = None
        if training_until is None and not buffer.empty():
            item = buffer.get_nowait()
            if item is None:
                break
            batch = await item
            rollouts = [r for g in batch.groups for r in g]
            batches.append({**batch.metrics, "tick": tick, "limit": limiter.limit,
                            "tokens": sum(r.result.completion_len for r in rollouts),
                            "staleness": max(batch.step - r.result.versions.first for r in rollouts)})  # fmt: skip
            training_until = trainer_ticks
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    return batches


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainer_ticks", [2, 12])
def test_no_stale_drops_in_the_steady_state_against_a_simulated_engine(trainer_ticks):
    """Batches of 8 groups of 4 (32 rollouts), every second group with one rollout 8x the others, 256 rollouts in
    flight allowed; the trainer faster than the engine (2 ticks a step) or slower (12). Formation takes the oldest
    groups first and waits for last-chance ones, so the long rollouts train within one step instead of being cut:
    nothing is dropped, the cap stays at its ceiling, and the engine is busy."""
    engine = SimEngine(rate=64, per_rollout=4)
    overrides = dict(batch_size=32, rollouts_per_example=4, async_level=1, max_off_policy_steps=1,
                     client={"initial_concurrent": 256, "max_concurrent": 256})  # fmt: skip
    batches = asyncio.run(simulate(engine, steps=12, trainer_ticks=trainer_ticks, **overrides))
    assert len(batches) == 12
    assert all(b["staleness"] <= 1 for b in batches)  # the bound holds throughout
    assert [b["off_policy/dropped"] for b in batches] == [0] * 12
    assert {b["limit"] for b in batches} == {256}
    steady = batches[2:]
    tokens = sum(b["tokens"] for b in steady[1:])
    # The engine samples at most 64 tokens a tick; each rollout at most 4 (a long one takes 16 ticks).
    assert tokens / (steady[-1]["tick"] - steady[0]["tick"]) > 20
