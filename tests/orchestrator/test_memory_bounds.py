"""What a long run would hold more of with every step or rollout, held to a bound: each case runs many distinct
rollouts (or steps) and counts what stays (benchmarks/soak.py measures a real run's processes)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from tests.orchestrator import test_hostile_inference as hostile
from tests.orchestrator.test_hostile_inference import FakeServer, env_worker_http  # noqa: F401


def test_failed_rollouts_leave_no_version_record_on_the_server(tmp_path):
    """The server records the versions of every tagged rollout's tokens until the orchestrator pops the record; only
    finished rollouts' were popped, so each failed one (an env error after a model turn) stayed on the server, one
    more per failure until its cap of 65536 records."""
    held: set[str] = set()

    async def versions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        found = {t: {"first": 0, "last": 0, "num_tokens": 1, "exact": True} for t in body["tags"] if t in held}
        if body.get("pop"):
            held.difference_update(body["tags"])
        return web.json_response({"versions": found})

    async def main():
        server = await FakeServer().start()
        server.versions = versions
        server.handler = lambda body: web.Response(text="not json")  # sampled, then the rollout fails
        orch = hostile.orchestrator(tmp_path, server)
        new_tag = orch.versions.new_tag

        def tag() -> str:  # the server records a tag as its first request starts (`VersionLedger.begin`)
            held.add(t := new_tag())
            return t

        orch.versions.new_tag = tag
        try:
            rollouts = [await orch._rollout(0, "reverse-text", 0, 0, i) for i in range(8)]
            await asyncio.sleep(0.2)  # the pops go out with the next flush
            return rollouts
        finally:
            await orch.versions.close()
            await server.stop()

    rollouts = asyncio.run(main())
    assert all(r.result.failed for r in rollouts), json.dumps([r.result.error for r in rollouts])[:500]
    assert held == set(), f"{len(held)} records of failed rollouts left on the server"


def test_an_env_naming_a_new_seat_in_every_rollout_grows_no_curriculum_state():
    """A seat's name is the env's: one named anew in every rollout added a difficulty entry per group for the whole
    run (and to curriculum.json, and to every draw's pass over the table). The first MAX_SEATS are kept; resumed, a
    run keeps the same ones."""
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
    from prime_orchestrator.curriculum import MAX_SEATS, Curriculum
    from prime_orchestrator.orchestrator import Rollout

    c = OrchestratorConfig.model_validate(
        {"batch_size": 8, "rollouts_per_example": 2, "env": [{"id": "e"}], "async_level": 0,
         "curriculum": {"sampler": "difficulty_pool", "dynamic_sampling": False}}
    )  # fmt: skip
    seq = TrainedSequence(token_ids=[5, 6], loss_mask=[False, True], logprobs=[0.0, -1.0])

    def group(step: int, gi: int) -> list[Rollout]:
        traces = [TraceResult(seat=f"seat-{step}-{gi}", reward=float(j), sequences=[seq]) for j in range(2)]
        return [
            Rollout("e", gi, gi, step, RolloutResult(env="e", example=gi, traces=[t], reward=t.reward)) for t in traces
        ]

    cur = Curriculum(c, {"e": 4})
    for step in range(100):
        asyncio.run(cur.fill(step, [group(step, gi) for gi in range(4)], None))
        cur.metrics(step)
        cur.plan(step + 1, ["e"] * 4, {"e": 0})
    assert len(cur.difficulty) == MAX_SEATS and len(cur.seats["e"]) == MAX_SEATS, len(cur.difficulty)
    resumed = Curriculum(c, {"e": 4})
    resumed.load_state_dict(json.loads(json.dumps(cur.state_dict(100))))
    assert resumed.difficulty == cur.difficulty and resumed.seats == cur.seats
