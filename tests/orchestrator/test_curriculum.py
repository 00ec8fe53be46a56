"""Difficulty curriculum and dynamic sampling: draws favour examples with signal, the batch is refilled up to its
size or the cap, and a resumed run draws exactly what an uninterrupted one does, whatever the timing."""

import asyncio
import json
import math
import random

import pytest
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
from prime_orchestrator.curriculum import Curriculum
from prime_orchestrator.orchestrator import Orchestrator, Rollout, StepBatch

NUM_EXAMPLES = {"easy": 40, "hard": 40}
G = 4


def config(tmp_path=None, **curriculum) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "output_dir": str(tmp_path or "outputs"),
            "batch_size": 8 * G,
            "rollouts_per_example": G,
            "async_level": curriculum.pop("async_level", 1),
            "seed": 3,
            "env": [{"id": "easy"}, {"id": "hard", "ratio": 1.0}],
            "curriculum": curriculum,
        }
    )


def reward(env: str, example: int, step: int, index: int) -> float:
    """Hard examples are never solved, easy ones with even index always, odd ones half the time (signal)."""
    if env == "hard" or example % 2 == 0:
        return float(env == "easy")
    return float((index + step) % 2)


def group(step: int, env: str, example: int, gi: int) -> list[Rollout]:
    seq = TrainedSequence(token_ids=[5, 6, 7], loss_mask=[False, True, True], logprobs=[0.0, -1.0, -1.0])
    results = [RolloutResult(env=env, example=example, reward=reward(env, example, step, j)) for j in range(G)]
    traces = [r.model_copy(update={"traces": [TraceResult(reward=r.reward, sequences=[seq])]}) for r in results]
    return [Rollout(env, example, gi, step, r) for r in traces]


def fill(cur: Curriculum, step: int, plan: list[tuple[str, int]]) -> list[list[Rollout]]:
    async def run(env, example, gi):
        await asyncio.sleep(0)
        return group(step, env, example, gi)

    first = [group(step, env, example, gi) for gi, (env, example) in enumerate(plan)]
    return asyncio.run(cur.fill(step, first, run))


def plan(cur: Curriculum, step: int, cursors: dict[str, int]) -> list[tuple[str, int]]:
    rng = random.Random(f"mix:{step}")
    return cur.plan(step, rng.choices(list(NUM_EXAMPLES), k=cur.groups_per_step), cursors)


def drive(cur: Curriculum, start: int, stop: int, *, eager: bool, cursors=None) -> tuple[list, dict]:
    """Steps start..stop-1 in an order the orchestrator allows: step n is dispatched (its first round planned) once
    step n - 1 - async_level shipped, its groups finish (and refill) later, steps ship in order. ``eager``: every
    allowed step is dispatched at once and finishes just before it ships; otherwise each step is dispatched after
    the previous one shipped and finishes at once."""
    cursors = cursors if cursors is not None else dict.fromkeys(NUM_EXAMPLES, 0)
    plans, draws, metrics, shipped = {}, {}, {}, start - 1
    a = cur.config.async_level
    while shipped < stop - 1:
        nxt = start + len(plans)
        if nxt < stop and nxt - 1 - a <= shipped and (eager or nxt == shipped + 1):
            plans[nxt] = plan(cur, nxt, cursors)
            if not eager:
                draws[nxt] = fill(cur, nxt, plans[nxt])
            continue
        shipped += 1
        if shipped not in draws:
            draws[shipped] = fill(cur, shipped, plans[shipped])
        metrics[shipped] = cur.metrics(shipped)
    return [[(g[0].env, g[0].example, g[0].train) for g in draws[s]] for s in range(start, stop)], metrics


def test_difficulty_pool_favours_examples_with_signal():
    cur = Curriculum(config(sampler="difficulty_pool"), NUM_EXAMPLES)
    draws, metrics = drive(cur, 0, 30, eager=False)
    late = [d for step in draws[20:] for d in step]
    with_signal = sum(env == "easy" and ex % 2 == 1 for env, ex, _ in late)
    # Uniform draws would give 1/4 odd easy examples; hard and solved ones fall to weight 0.2 once scored.
    assert with_signal / len(late) > 0.5
    assert metrics[29]["curriculum/pool/hard"] > 30 and metrics[29]["curriculum/pool/unseen"] < 20


def test_gate_without_refill_drops_groups_without_signal():
    cur = Curriculum(config(sampler="difficulty_pool"), NUM_EXAMPLES)
    groups = fill(cur, 0, [("easy", 0), ("easy", 1), ("hard", 5), ("easy", 3)])
    assert [g[0].train for g in groups] == [False, True, False, True]
    assert cur.pending[0]["draws"] == 4 and cur.pending[0]["trained"] == 2


def test_dynamic_sampling_fills_the_batch():
    # A quarter of the examples carry signal; up to 8 times the batch's groups may be drawn.
    cur = Curriculum(config(dynamic_sampling=True, max_draws_factor=8), NUM_EXAMPLES)
    draws, metrics = drive(cur, 0, 6, eager=False)
    for step, m in metrics.items():
        assert sum(t for _, _, t in draws[step]) == 8  # a full batch of groups with signal, every step
        assert m["curriculum/admitted"] >= 8 and m["curriculum/draws"] == len(draws[step]) > 8
        assert m["curriculum/draws"] <= 64 and m["curriculum/rollouts"] == G * m["curriculum/draws"]
    assert metrics[5]["curriculum/draws_total"] == sum(len(d) for d in draws)
    assert metrics[5]["curriculum/trained_total"] == 48


def test_dynamic_sampling_stops_at_the_cap():
    cur = Curriculum(config(dynamic_sampling=True, max_draws_factor=2.0), {"easy": 2, "hard": 40})
    cur.ratios = [0.0, 1.0]  # only hard draws after the first round: no group carries signal
    groups = fill(cur, 0, [("hard", i) for i in range(8)])
    assert len(groups) == 16 and not any(g[0].train for g in groups)
    assert cur.pending[0]["rounds"] > 1


@pytest.mark.parametrize("async_level", [0, 1, 2])
def test_draws_do_not_depend_on_timing(async_level):
    kwargs = {"sampler": "difficulty_pool", "dynamic_sampling": True, "async_level": async_level}
    eager, _ = drive(Curriculum(config(**kwargs), NUM_EXAMPLES), 0, 10, eager=True)
    lazy, _ = drive(Curriculum(config(**kwargs), NUM_EXAMPLES), 0, 10, eager=False)
    assert eager == lazy


@pytest.mark.parametrize("sampler", ["difficulty_pool", "sequential"])
@pytest.mark.parametrize("async_level", [0, 2])
def test_resume_gets_the_same_draws(tmp_path, sampler, async_level):
    kwargs = {"sampler": sampler, "dynamic_sampling": True, "async_level": async_level}
    straight, straight_metrics = drive(Curriculum(config(**kwargs), NUM_EXAMPLES), 0, 12, eager=True)

    # Stop after shipping step 5; the checkpoint of step 6 is written when steps up to 5 + async_level may already
    # have been drawn (each needs only step n - 1 - async_level shipped).
    first = Curriculum(config(**kwargs), NUM_EXAMPLES)
    cursors = dict.fromkeys(NUM_EXAMPLES, 0)
    drive(first, 0, 6, eager=False, cursors=cursors)
    for step in range(6, 6 + async_level):
        fill(first, step, plan(first, step, cursors))
    saved = json.loads(json.dumps(first.state_dict(6)))

    resumed = Curriculum(config(**kwargs), NUM_EXAMPLES)
    resumed.load_state_dict(saved)
    cursors = {env: sum(env == e for d in straight[:6] for e, _, _ in d[:8]) for env in NUM_EXAMPLES}
    rest, rest_metrics = drive(resumed, 6, 12, eager=False, cursors=cursors)
    assert rest == straight[6:]
    assert rest_metrics[11] == straight_metrics[11]


def test_orchestrator_hook_trains_admitted_groups_and_checkpoints(tmp_path, monkeypatch):
    c = config(tmp_path, sampler="difficulty_pool", dynamic_sampling=True, max_draws_factor=8)
    orch = Orchestrator(c)
    orch.curriculum.start(NUM_EXAMPLES)

    async def rollout(self, step, env, example, gi, index):
        return group(step, env, example, gi)[index % G]

    monkeypatch.setattr(Orchestrator, "_rollout", rollout)
    batch = asyncio.run(orch._generate_step(0, orch._plan_step(0), StepBatch(0, [], 0.0, 0.0)))
    samples, extra = orch._samples(batch)
    trained = [g for g in batch.groups if g[0].train]
    assert len(trained) == 8 and len(samples) == 8 * G  # only the trained groups become samples
    assert extra["filtered/groups"] == len(batch.groups) - 8
    orch.curriculum.metrics(0)
    orch._save_checkpoint(1)
    state = json.loads((orch.run_dir.orchestrator_checkpoint(1) / "curriculum.json").read_text())
    assert state["pending"]["0"]["trained"] == 8

    resumed = Curriculum(c.model_copy(update={"ckpt": c.ckpt.model_copy(update={"resume_step": 1})}), NUM_EXAMPLES)
    assert resumed.pending[0] == orch.curriculum.pending[0]


def test_unbounded_taskset_is_a_one_line_error():
    with pytest.raises(ValueError, match="curriculum needs finite tasksets; env 'hard'"):
        Curriculum(config(dynamic_sampling=True), {"easy": 4, "hard": 0})
    off = Curriculum(config(), {"easy": 4, "hard": 0})  # off by default: any taskset, sequential draws, no metrics
    cursors = {"easy": 2, "hard": 0}
    assert off.plan(0, ["easy", "hard", "easy"], cursors) == [("easy", 2), ("hard", 0), ("easy", 3)]
    assert cursors == {"easy": 4, "hard": 1} and off.metrics(0) == {}


def duel(example: int, step: int, gi: int) -> list[Rollout]:
    """A zero-sum two-seat game: the mean over seats is 0.5 in every episode. Even examples: the first player always
    wins; odd ones: the winner alternates (each seat has signal)."""
    seq = TrainedSequence(token_ids=[5, 6], loss_mask=[False, True], logprobs=[0.0, -1.0])
    out = []
    for j in range(G):
        first = 1.0 if example % 2 == 0 else float(j % 2)
        traces = [TraceResult(seat=s, reward=r, sequences=[seq]) for s, r in (("white", first), ("black", 1 - first))]
        out.append(
            Rollout("duel", example, gi, step, RolloutResult(env="duel", example=example, traces=traces, reward=0.5))
        )
    return out


def test_multi_agent_difficulty_and_gate_are_per_seat():
    c = OrchestratorConfig.model_validate(
        {
            "batch_size": 4 * G,
            "rollouts_per_example": G,
            "env": [{"id": "duel"}],
            "async_level": 0,
            "curriculum": {"sampler": "difficulty_pool", "dynamic_sampling": False},
        }  # fmt: skip
    )
    cur = Curriculum(c, {"duel": 8})
    # The averaged reward is 0.5 everywhere (no advantage); per seat, the odd examples' groups carry signal.
    groups = [duel(example, 0, gi) for gi, example in enumerate(range(4))]
    assert [cur.admits(g) for g in groups] == [False, True, False, True]
    asyncio.run(cur.fill(0, groups, None))
    assert sorted(cur.pending[0]["scores"])[:2] == [["duel", 0, "black", 0.0], ["duel", 0, "white", 1.0]]
    m = cur.metrics(0)
    # Each seat of examples 0 and 2 is solved or hopeless (weight 0.2); 1 and 3 are normal for both seats (weight 1).
    assert cur._weights("duel", {}) == [0.2, 1.0, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert m["curriculum/pool/easy"] == 2 and m["curriculum/pool/hard"] == 2 and m["curriculum/pool/normal"] == 4
    assert m["curriculum/pool/unseen"] == 4 and m["curriculum/admitted"] == 2
    state = json.loads(json.dumps(cur.state_dict(1)))
    resumed = Curriculum(c, {"duel": 8})
    resumed.load_state_dict(state)
    assert resumed.difficulty == cur.difficulty


def test_checkpoint_without_seats_loads_as_the_single_seat():
    cur = Curriculum(config(sampler="difficulty_pool"), NUM_EXAMPLES)
    old = {"folded_through": 0, "totals": {"draws": 1, "admitted": 1, "trained": 1},
           "difficulty": [["easy", 3, 0.5, 1]], "pending": {"1": {"scores": [["hard", 2, 0.0]], "draws": 1,
           "admitted": 0, "trained": 0, "rounds": 1}}}  # fmt: skip
    cur.load_state_dict(old)
    assert cur.difficulty == {("easy", 3, "agent"): (0.5, 1)}
    assert cur.pending[1]["scores"] == [["hard", 2, "agent", 0.0]]


def scored(rewards: list[float] | None, step: int, example: int = 0) -> list[Rollout]:
    """A group of ``easy`` example ``example`` with these rewards; None: every rollout failed."""
    seq = TrainedSequence(token_ids=[5, 6], loss_mask=[False, True], logprobs=[0.0, -1.0])
    if rewards is None:
        results = [RolloutResult(env="easy", example=example, failed=True, error="env error")] * G
    else:
        results = [RolloutResult(env="easy", example=example, reward=r, traces=[TraceResult(reward=r, sequences=[seq])])
                   for r in rewards]  # fmt: skip
    return [Rollout("easy", example, 0, step, r) for r in results]


def test_huge_rewards_leave_the_running_mean_finite_and_it_recovers():
    """Rewards of 1e308 are finite (screening passes them): their mean summed to inf, and the next honest group's
    ``inf + ema * (x - inf)`` made the example's running mean NaN for the rest of the run (the last pool, whatever
    it scored later), written as NaN into the checkpoint."""
    cur = Curriculum(config(sampler="difficulty_pool", async_level=0), NUM_EXAMPLES)
    for step, rewards in enumerate([[1e308] * G, [-1e308] * G] + [[0.0, 0.0, 1.0, 1.0]] * 3):
        asyncio.run(cur.fill(step, [scored(rewards, step)], None))
        metrics = cur.metrics(step)
    mean, n = cur.difficulty[("easy", 0, "agent")]
    assert n == 5 and mean == 0.4375  # 1e308 and -1e308 average to 0 at ema 0.5; then 0.25, 0.375, 0.4375
    assert all(math.isfinite(v) for v in metrics.values())
    json.dumps(cur.state_dict(5), allow_nan=False)


def test_a_task_whose_every_rollout_fails_and_is_dropped_is_scored_not_left_unseen():
    """With ``failed_rollouts = "drop"`` such a group had no score: the example stayed unseen, drawn at
    ``unseen_weight`` (as often as an example with signal) for the whole run while training nothing."""
    c = config(sampler="difficulty_pool", async_level=0).model_copy(update={"failed_rollouts": "drop"})
    cur = Curriculum(c, NUM_EXAMPLES)
    for step in range(3):
        groups = asyncio.run(cur.fill(step, [scored(None, step, example=1)], None))
        assert not any(r.train for g in groups for r in g)
        metrics = cur.metrics(step)
    assert cur.difficulty[("easy", 1, "agent")] == (0.0, 3)
    assert cur._weights("easy", {})[:3] == [1.0, 0.2, 1.0]  # the hard pool's weight; unseen ones keep 1.0
    assert metrics["curriculum/pool/hard"] == 1 and metrics["curriculum/pool/unseen"] == 79


def test_a_curriculum_with_nothing_left_to_draw_ends_the_run_in_one_line(capsys, tmp_path):
    """Pools of weight 0 for solved and hopeless examples (prime-rl's way to skip them): once a policy solved every
    example, the next draw raised a ValueError the entry point did not know, and the run ended in a traceback."""
    from prime_orchestrator.entrypoints.orchestrator import run

    pools = {"hard": {"threshold": 0.25, "weight": 0}, "normal": {"threshold": 0.75, "weight": 1},
             "easy": {"threshold": 1.0, "weight": 0}}  # fmt: skip
    c = config(sampler="difficulty_pool", async_level=0, pools=pools)
    cur = Curriculum(c, {"easy": 2, "hard": 2})
    for step in range(2):
        asyncio.run(cur.fill(step, [scored([1.0] * G, step, example=e) for e in (0, 1)], None))
        cur.metrics(step)
    assert cur.plan(2, ["hard"], {}) != []  # the other env still has unseen examples

    class Orch:
        @staticmethod
        async def run():
            cur.plan(2, ["hard", "easy"], {})

    with pytest.raises(SystemExit) as exited:
        run(Orch(), tmp_path)
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1
    assert err == (
        "error: curriculum: nothing left to draw in env 'easy': every example weighs 0 "
        "(curriculum.pools.hard.weight, curriculum.pools.easy.weight = 0)\n"
    )
