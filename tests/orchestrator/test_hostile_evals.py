"""``evaluate_env`` against environments that misbehave: a scoring function that returns NaN or infinity must not
turn the environment's whole summary (and ``results.json``) into NaN; the rollout counts as failed, as in training."""

from __future__ import annotations

import asyncio
import json
import math

from prime_core.schemas.rollout import RolloutResult
from prime_orchestrator.evals import evaluate_env


class FakeRunner:
    """Rollout ``i`` scores ``rewards[i]`` (``metrics[i]`` recorded with it)."""

    def __init__(self, rewards: list[float], metrics: list[dict] | None = None):
        self.rewards, self.metrics = rewards, metrics or [{} for _ in rewards]
        self.num_examples = len(rewards)

    async def rollout(self, example, *, client, model, sampling):
        return RolloutResult(
            env="e",
            example=example,
            reward=self.rewards[example],
            metrics=self.metrics[example],
            prompt=f"prompt {example}",
            completion=f"completion {example}",
            num_turns=1,
        )


def _evaluate(runner: FakeRunner):
    return asyncio.run(
        evaluate_env(
            runner,
            client_for=lambda i: None,
            model="m",
            num_examples=runner.num_examples,
            rollouts_per_example=1,
            sampling=type("S", (), {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8})(),
            seed=0,
        )
    )


def test_a_non_finite_reward_fails_its_rollout_and_the_summary_stays_finite():
    summary, rows = _evaluate(FakeRunner([1.0, math.nan, 0.0, math.inf]))
    # The other rollouts still measure something: mean over all four, the two bad ones scoring 0.
    assert summary["reward/mean"] == 0.25 and summary["failed"] == 2
    assert [r["failed"] for r in rows] == [False, True, False, True]
    assert "not finite: reward = nan" in rows[1]["error"] and rows[1]["reward"] == 0.0
    assert rows[1]["completion"] == "completion 1"  # kept, to see what was scored
    json.dumps({"summary": summary, "rollouts": rows}, allow_nan=False)  # results.json stays standard JSON


def test_a_non_finite_metric_fails_its_rollout_and_leaves_the_rows_standard_json():
    summary, rows = _evaluate(FakeRunner([1.0, 1.0], [{"acc": 1.0}, {"acc": -math.inf}]))
    assert summary["reward/mean"] == 0.5 and summary["failed"] == 1
    assert "acc = -inf" in rows[1]["error"]
    json.dumps({"summary": summary, "rollouts": rows}, allow_nan=False)
