"""Per-seat credit: each trainable trace trains on its own reward, its advantage taken against its seat's traces in
the group (self-play trains both seats of a zero-sum game; attempts of one seat are compared with each other)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytest
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
from prime_orchestrator.credit import seat_step_metrics, step_samples
from prime_orchestrator.metric_keys import MetricKeyCap


@dataclass
class Rollout:
    result: RolloutResult
    env: str = "duel"
    weight_step: int = 0


def seq(n: int = 2) -> TrainedSequence:
    return TrainedSequence(token_ids=[1] * (n + 1), loss_mask=[False] + [True] * n, logprobs=[0.0] + [-0.1] * n)


def rollout(*seats: tuple[str, float], failed: bool = False) -> Rollout:
    if failed:
        return Rollout(RolloutResult(env="duel", example=0, failed=True, error="boom"))
    traces = [TraceResult(seat=s, reward=r, sequences=[seq()]) for s, r in seats]
    mean = sum(r for _, r in seats) / len(seats)
    return Rollout(RolloutResult(env="duel", example=0, traces=traces, reward=mean))


def config(**kw) -> OrchestratorConfig:
    return OrchestratorConfig(**{"batch_size": 4, "rollouts_per_example": 4, **kw})


def test_zero_sum_self_play_trains_both_seats_where_the_mean_payoff_is_always_zero():
    # each episode: one seat wins (+1), the other loses (-1); the rollout's mean reward is 0 every time
    group = [rollout(("a", 1.0), ("b", -1.0)), rollout(("a", -1.0), ("b", 1.0)),
             rollout(("a", 1.0), ("b", -1.0)), rollout(("a", 1.0), ("b", -1.0))]  # fmt: skip
    assert {r.result.reward for r in group} == {0.0}
    samples, m = step_samples([group], config())
    assert len(samples) == 8 and m["filtered/groups"] == 0 and m["advantage/nonzero_fraction"] == 1.0
    # seat a: rewards [1, -1, 1, 1], mean 0.5 -> [0.5, -1.5, 0.5, 0.5]; seat b mirrors it (samples seat by seat)
    np.testing.assert_allclose([s.advantage for s in samples], [0.5, -1.5, 0.5, 0.5, -0.5, 1.5, -0.5, -0.5])
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0]


def test_attempts_of_one_seat_each_train_on_their_own_reward():
    group = [rollout(("agent", 1.0), ("agent", 0.0)), rollout(("agent", 0.0), ("agent", 0.0))]
    samples, _ = step_samples([group], config(rollouts_per_example=2))
    np.testing.assert_allclose([s.advantage for s in samples], [0.75, -0.25, -0.25, -0.25])


def test_a_seat_without_signal_is_filtered_while_the_other_trains():
    group = [rollout(("a", 1.0), ("b", 0.0)), rollout(("a", 1.0), ("b", 1.0))]
    samples, m = step_samples([group], config(rollouts_per_example=2))
    assert [s.reward for s in samples] == [0.0, 1.0]  # seat b only
    assert m["filtered/seat_groups"] == 1 and m["filtered/groups"] == 0
    samples, m = step_samples([group[:1] * 2], config(rollouts_per_example=2))
    assert samples == [] and m["filtered/groups"] == 1 and m["filtered/seat_groups"] == 2


def test_a_failed_rollout_is_a_zero_reward_for_every_seat_or_dropped():
    group = [rollout(("a", 1.0), ("b", 1.0)), rollout(failed=True)]
    samples, _ = step_samples([group], config(rollouts_per_example=2))
    np.testing.assert_allclose([s.advantage for s in samples], [0.5, 0.5])
    samples, m = step_samples([group], config(rollouts_per_example=2, failed_rollouts="drop"))
    assert samples == [] and m["filtered/groups"] == 1  # one rollout left per seat: no baseline


def test_single_seat_groups_are_plain_grpo():
    group = [rollout(("agent", r)) for r in (0.0, 0.0, 1.0, 1.0)]
    samples, _ = step_samples([group], config())
    np.testing.assert_allclose([s.advantage for s in samples], [-0.5, -0.5, 0.5, 0.5])


def test_seat_metrics_are_logged_per_seat_for_multi_seat_envs_only():
    results = [rollout(("a", 1.0), ("b", -1.0)).result, rollout(("a", -1.0), ("b", 1.0)).result]
    # A metric lives on its trace (``to_result``); the rollout's ``metrics`` are derived from them.
    results[0].traces[0].metrics = {"moves": 2.0}
    results[0].traces[1].metrics = {"moves": 4.0}
    m = seat_step_metrics("duel", results, MetricKeyCap())
    assert m["reward/duel/a/mean"] == 0.0 and m["reward/duel/b/std"] == 1.0 and m["metrics/duel/a/moves"] == 2.0
    assert m["metrics/duel/moves"] == 3.0  # seats pooled, as vf-eval summarizes a run
    single = seat_step_metrics("one", [rollout(("agent", 1.0)).result], MetricKeyCap())
    assert not any(k.startswith("reward/") for k in single)


def test_a_seat_whose_advantages_overflow_is_not_trained_and_the_step_still_is(caplog):
    """Each reward is finite (screened), yet 1e308 x 4 sums to inf: that seat's advantages would be -inf and the
    trainer's gradient for the whole step non-finite."""
    huge = [rollout(("a", 1e308), ("b", r)) for r in (0.0, 1.0, 0.0, 1.0)]
    fine = [rollout(("a", r), ("b", 0.0)) for r in (0.0, 1.0, 1.0, 0.0)]
    samples, m = step_samples([huge, fine], config())
    assert m["filtered/overflowed_seat_groups"] == 1
    assert not any(s.reward > 1e300 for s in samples)  # seat a of the huge group
    assert len(samples) == 4 + 4  # seat b of the huge group, seat a of the fine one (its b has no signal)
    assert all(np.isfinite(s.advantage) for s in samples) and np.isfinite(m["advantage/abs_mean"])
    assert "env duel: the advantages of seat 'a' overflow (rewards up to 1e+308)" in caplog.text


def test_a_seat_whose_finite_advantages_exceed_max_abs_is_named_and_not_trained(caplog):
    """A reward function returning 1e18: the advantages are finite, so before they trained. On the tiny test model
    that step's gradient norm was 1.5e17, which clipping scaled to 1: the one sample set the step's direction and every
    other sample's share became nothing (from about 1e19 the norm was infinite and the whole step skipped)."""
    huge = [rollout(("a", r), ("b", b)) for r, b in ((1e18, 0.0), (0.0, 1.0), (0.0, 0.0), (0.0, 1.0))]
    fine = [rollout(("a", r), ("b", 0.0)) for r in (0.0, 1.0, 1.0, 0.0)]
    samples, m = step_samples([huge, fine], config())
    assert m["filtered/overflowed_seat_groups"] == 1
    assert max(abs(s.advantage) for s in samples) == 0.5 and len(samples) == 4 + 4
    assert (
        "env duel: the advantages of seat 'a' reach 7.5e+17, over advantage.max_abs = 1e+06 (rewards up to 1e+18): "
        "that seat of the group is not trained" in caplog.text
    )
    # Unset, the bound is float32's: the seat trains as before (its rewards are the user's scale).
    samples, m = step_samples([huge], config(advantage={"max_abs": None}))
    assert m["filtered/overflowed_seat_groups"] == 0 and max(abs(s.advantage) for s in samples) == 7.5e17


def test_a_sequence_whose_distillation_advantages_pass_max_abs_is_named_and_not_trained(caplog):
    """A distillation advantage is log p_teacher - log p_student per token: a student log-prob of -1e30 (finite, so the
    sample checks let it through) trained as an advantage of 1e30 on one token, which alone set the step's direction
    (the group advantages' ``advantage.max_abs`` did not look at the per-token signal)."""
    from prime_core.config.distill import DistillConfig, TeacherConfig
    from prime_orchestrator.distill import Teachers

    distill = DistillConfig(teacher=TeacherConfig(base_url="http://127.0.0.1:1", model="t")).model_dump()
    c = config(env=[{"id": "duel", "distill": distill}])

    def scored(student: float) -> Rollout:
        q = TrainedSequence(token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[0.0, -0.1, student],
                            teacher_logprobs=[0.0, -0.2, -0.5])  # fmt: skip
        return Rollout(
            RolloutResult(env="duel", example=0, traces=[TraceResult(reward=1.0, sequences=[q])], reward=1.0)
        )

    samples, m = step_samples([[scored(-1e30), scored(-0.1), scored(-0.2), scored(-3e38)]], c, Teachers(c))
    assert len(samples) == 2 and max(abs(a) for s in samples for a in s.advantage) == pytest.approx(0.4)
    assert m["filtered/overflowed_sequences"] == 2
    assert (
        "env duel: the distillation advantages of a sequence of seat 'agent' reach 1e+30, over advantage.max_abs"
        in caplog.text
    )


def test_an_env_that_names_a_new_metric_every_rollout_logs_at_most_the_cap(caplog):
    """A reward keyed by the answer made a new metrics.jsonl / W&B column per rollout, without bound."""
    cap = MetricKeyCap(limit=4)
    logged: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="prime.orchestrator.metrics"):
        for step in range(10):
            results = [rollout(("agent", 1.0)).result for _ in range(3)]
            for i, r in enumerate(results):
                r.traces[0].metrics = {"steady": 1.0, f"answer_{step}_{i}": 1.0}
            m = seat_step_metrics("spam", results, key_cap=cap)
            logged |= {k for k in m if k.startswith("metrics/spam/")}
    assert len(logged) == 4 and "metrics/spam/steady" in logged and m["metrics/spam/steady"] == 1.0
    assert m["metrics_dropped/spam"] == 3  # the names dropped from this step's metrics
    assert cap.num_dropped["spam"] == 10 * 3 + 1 - 4  # every name past the cap, counted
    lines = [r for r in caplog.records if "distinct metric names" in r.getMessage()]
    assert len(lines) == 1 and "spam" in lines[0].getMessage()


def test_the_metric_name_cap_holds_no_more_names_than_its_limit_however_many_it_drops():
    """It kept every distinct dropped name, per env: 100 steps of 100 rollouts each naming a new metric left 10,000
    names (1.27 MB traced) in the cap that bounds the metrics' memory; now the 64 kept names (7.7 KB), and a count."""
    cap = MetricKeyCap()
    for step in range(100):
        m = cap.apply("spam", {f"metrics/spam/answer_{step}_{i}": 1.0 for i in range(100)})
    assert m["metrics_dropped/spam"] == 100 and cap.num_dropped["spam"] == 100 * 100 - 64
    names = [n for attr in vars(cap).values() if isinstance(attr, dict) for v in attr.values() if isinstance(v, set)
             for n in v]  # fmt: skip
    assert len(names) == 64, len(names)


def test_each_env_runner_has_its_own_metric_name_cap():
    """The cap was one module-level object: a second run of an env in the same process (or a second orchestrator)
    started with the first's 64 names kept, and logged none of its own."""
    from prime_core.schemas.rollout import EnvServerSpec
    from prime_orchestrator.envs import EnvRunner

    spec = EnvServerSpec(name="spam", env_config={})
    for run in range(2):
        runner = EnvRunner(None, spec, max_retries=0)
        results = [rollout(("agent", 1.0)).result for _ in range(64)]
        for i, r in enumerate(results):
            r.traces[0].metrics = {f"run{run}_{i}": 1.0}
        m = seat_step_metrics("spam", results, runner.metric_keys)
        assert len([k for k in m if k.startswith("metrics/spam/")]) == 64 and "metrics_dropped/spam" not in m
