"""Evaluation: rollouts on eval environments, mean reward and unbiased pass@k."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
from prime_core.schemas.rollout import RolloutResult

from prime_orchestrator.envs import EnvRunner, request_seed, sampling_args
from prime_orchestrator.liveness import not_finite
from prime_orchestrator.traces import summary_metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def summarize(rewards_per_example: list[list[float]], threshold: float = 1.0) -> dict[str, Any]:
    """Mean/std reward and pass@k (a rollout counts as correct when reward >= threshold)."""
    flat = np.array([r for rs in rewards_per_example for r in rs], dtype=float)
    n = min(len(rs) for rs in rewards_per_example)
    out: dict[str, Any] = {
        "reward/mean": float(flat.mean()),
        "reward/std": float(flat.std()),
        "num_examples": len(rewards_per_example),
        "rollouts_per_example": n,
    }
    for k in ks_up_to(n):
        out[f"pass@{k}"] = float(
            np.mean([pass_at_k(len(rs), sum(r >= threshold for r in rs), k) for rs in rewards_per_example])
        )
    return out


async def evaluate_env(
    runner: EnvRunner,
    *,
    client_for: Any,
    model: str,
    num_examples: int,
    rollouts_per_example: int,
    sampling: Any,
    seed: int,
    semaphore: asyncio.Semaphore | None = None,
    track: Any = None,
) -> tuple[dict[str, Any], list[dict]]:
    """Rollouts of the first ``num_examples`` tasks (all of a smaller finite taskset); a failed rollout scores 0, and so
    does one whose reward or a metric is not finite (it counts as failed).
    ``track(rollout)`` awaits each one (the orchestrator's ``evals`` lane of its progress file)."""
    semaphore = semaphore or asyncio.Semaphore(64)

    async def one(example: int, j: int) -> Any:
        index = example * rollouts_per_example + j
        async with semaphore:
            rollout = runner.rollout(
                example,
                client=client_for(index),
                model=model,
                sampling=sampling_args(sampling, seed=request_seed(seed, -2, index)),
            )
            return _finite(await (track(rollout) if track is not None else rollout))

    count = min(num_examples, runner.num_examples) if runner.num_examples else num_examples
    examples = list(range(count))
    results = await asyncio.gather(*(one(e, j) for e in examples for j in range(rollouts_per_example)))
    per_example = [
        [results[i * rollouts_per_example + j].reward for j in range(rollouts_per_example)]
        for i in range(len(examples))
    ]
    fields = {"example", "reward", "failed", "error", "prompt", "completion", "num_turns", "metrics"}
    rows = [{**r.model_dump(include=fields), "traces": [(t.seat, t.reward) for t in r.traces]} for r in results]
    summary = summarize(per_example)
    seats = {t.seat for r in results for t in r.traces}
    for seat in sorted(seats) if len(seats) > 1 else []:
        summary[f"reward/{seat}/mean"] = float(np.mean([t.reward for r in results for t in r.traces if t.seat == seat]))
    # Each reward function's score and each metric, averaged over the traces that report it: vf-eval's summary; at
    # most ``MAX_ENV_METRIC_KEYS`` names over the runner's evals (``metric_keys``), the rest counted in metrics_dropped.
    named = {f"metrics/{k}": v for k, v in summary_metrics(results).items()}
    summary.update(runner.metric_keys.apply(runner.name, named, count_key="metrics_dropped"))
    summary["failed"] = sum(r.failed for r in results)
    summary["num_turns/mean"] = float(np.mean([r.num_turns for r in results]))
    return summary, rows


def _finite(result: RolloutResult) -> RolloutResult:
    """A rollout whose reward or a metric is not finite fails (scores 0), as in training: one NaN made the whole
    environment's mean NaN, and its rows non-standard JSON. Its text stays, to show what was scored."""
    if (error := not_finite(result)) is None:
        return result
    if result.failed:  # what verifiers recorded before the failure: left out of the means when not finite
        return result.model_copy(update={"metrics": {}, "traces": []})
    return result.model_copy(update={"failed": True, "error": error, "reward": 0.0, "metrics": {}, "traces": []})


async def evaluate_envs(runners: dict[str, EnvRunner], **kwargs: Any) -> dict[str, dict[str, Any]]:
    results = await asyncio.gather(*(evaluate_env(r, **kwargs) for r in runners.values()))
    return {name: summary for name, (summary, _) in zip(runners, results, strict=True)}


def format_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """results[weights_label][env] = summary -> a fixed-width table."""
    keys = ["reward/mean", "reward/std"]
    for per_env in results.values():
        for s in per_env.values():
            keys += [k for k in s if k.startswith("pass@") and k not in keys]
    # failed: rollouts that scored 0 without measuring the model (a server that died mid-eval), within the mean.
    header = ["weights", "env", "n", "failed", *keys]
    lines = [header]
    for label, per_env in results.items():
        for env, s in per_env.items():
            lines.append(
                [
                    label,
                    env,
                    str(s["num_examples"] * s["rollouts_per_example"]),
                    str(s.get("failed", "-")),
                    *[f"{s[k]:.4f}" if k in s else "-" for k in keys],
                ]
            )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
