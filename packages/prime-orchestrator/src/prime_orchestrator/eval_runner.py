"""The ``eval`` process: environments x weights (base and checkpoints) -> JSON results and a table."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from prime_core.config.orchestrator import ClientConfig, EvalConfig
from prime_core.io import atomic_write_json, atomic_write_text

from prime_orchestrator import client as inference
from prime_orchestrator.env_pool import EnvPool, worker_spec
from prime_orchestrator.evals import evaluate_pool, format_table

logger = logging.getLogger("prime.eval")


async def run_eval(config: EvalConfig) -> dict[str, dict[str, dict[str, Any]]]:
    c = config
    key = c.client.resolved_api_key()
    await inference.wait_healthy(c.client.base_urls, api_key=key, timeout=c.client.health_timeout)
    pools = {}
    for env_id in c.environment_ids:
        spec = worker_spec(
            env_id=env_id,
            env_args=c.env_args.get(env_id, {}),
            model=c.model.name,
            model_dir=c.model.name,
            client=c.client,
            mode="chat" if c.use_chat else "generate",
            max_turns=c.max_turns,
        )
        pools[env_id] = EnvPool(env_id, spec, c.num_workers)
    await asyncio.gather(*(p.start() for p in pools.values()))
    labels: list[tuple[str, int | None]] = []
    if c.eval_base:
        labels.append(("base", None))
    if c.steps and c.weights_dir is None:
        raise ValueError("--steps needs --weights-dir")
    labels += [(f"step_{s}", s) for s in c.steps]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    out_dir = Path(c.output_dir) / "eval"
    semaphore = asyncio.Semaphore(c.client.max_concurrent)
    try:
        for label, step in labels:
            if step is not None:
                await inference.update_weights(
                    c.client.base_urls,
                    str(Path(c.weights_dir) / f"step_{step}"),
                    step,
                    api_key=key,
                    timeout=c.client.update_weights_timeout,
                    retries=c.client.max_retries,
                )
            results[label] = {}
            for env_id, pool in pools.items():
                summary, rows = await evaluate_pool(
                    pool,
                    num_examples=c.num_examples,
                    rollouts_per_example=c.rollouts_per_example,
                    sampling=c.sampling,
                    seed=c.seed,
                    semaphore=semaphore,
                )
                results[label][env_id] = summary
                atomic_write_json(out_dir / label / f"{env_id}.json", {"summary": summary, "rollouts": rows})
                logger.info("%s %s: reward %.4f", label, env_id, summary["reward/mean"])
    finally:
        await asyncio.gather(*(p.close() for p in pools.values()), return_exceptions=True)
    atomic_write_json(out_dir / "results.json", results)
    table = format_table(results)
    atomic_write_text(out_dir / "results.txt", table + "\n")
    print(table, flush=True)
    return results


__all__ = ["ClientConfig", "run_eval"]
