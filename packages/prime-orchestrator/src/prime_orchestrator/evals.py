"""Evaluation: rollouts on eval environments, mean reward and unbiased pass@k."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from prime_orchestrator.env_pool import EnvPool


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


async def evaluate_pool(
    pool: EnvPool,
    *,
    num_examples: int,
    rollouts_per_example: int,
    sampling: Any,
    seed: int,
    semaphore: asyncio.Semaphore | None = None,
) -> tuple[dict[str, Any], list[dict]]:
    from prime_orchestrator.orchestrator import request_seed

    params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    semaphore = semaphore or asyncio.Semaphore(64)

    async def one(example: int, j: int) -> dict[str, Any]:
        async with semaphore:
            return await pool.run(
                {
                    "example": example,
                    "sampling": params,
                    "seed": request_seed(seed, -2, example * rollouts_per_example + j),
                }
            )

    examples = list(range(min(num_examples, pool.num_examples)))
    results = await asyncio.gather(*(one(e, j) for e in examples for j in range(rollouts_per_example)))
    per_example = [
        [results[i * rollouts_per_example + j]["reward"] for j in range(rollouts_per_example)]
        for i in range(len(examples))
    ]
    rows = [
        {
            "example": r["example"],
            "reward": r["reward"],
            "prompt": r["prompt"],
            "completion": r["completion"],
            "num_turns": r["num_turns"],
            "signals": r["signals"],
        }
        for r in results
    ]
    return summarize(per_example), rows


async def evaluate_envs(pools: dict[str, EnvPool], **kwargs: Any) -> dict[str, dict[str, Any]]:
    results = await asyncio.gather(*(evaluate_pool(p, **kwargs) for p in pools.values()))
    return {name: summary for name, (summary, _) in zip(pools, results, strict=True)}


def format_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """results[weights_label][env] = summary -> a fixed-width table."""
    keys = ["reward/mean", "reward/std"]
    for per_env in results.values():
        for s in per_env.values():
            keys += [k for k in s if k.startswith("pass@") and k not in keys]
    header = ["weights", "env", "n", *keys]
    lines = [header]
    for label, per_env in results.items():
        for env, s in per_env.items():
            lines.append(
                [
                    label,
                    env,
                    str(s["num_examples"] * s["rollouts_per_example"]),
                    *[f"{s[k]:.4f}" if k in s else "-" for k in keys],
                ]
            )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
