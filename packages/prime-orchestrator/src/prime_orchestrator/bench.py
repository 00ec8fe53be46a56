"""``orchestrator --bench``: inference throughput in isolation (no trainer, no weights): one-turn rollouts of the
first environment, ``bench_config.num_requests`` of them, as many at a time as the client's concurrency allows."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from prime_core.io import atomic_write_json
from prime_core.schemas.rollout import RolloutResult

from prime_orchestrator import client as inference
from prime_orchestrator.envs import request_seed, sampling_args

if TYPE_CHECKING:
    from prime_orchestrator.orchestrator import Orchestrator


async def run_bench(orch: Orchestrator) -> dict[str, Any]:
    c = orch.config
    await inference.wait_healthy(
        c.client.base_urls, api_key=c.client.resolved_api_key(), timeout=c.client.health_timeout
    )
    env = c.env[0].model_copy(update={"max_turns": 1})
    runner = orch._runner(env, env.resolved_name)
    await runner.start()
    try:
        t0 = time.perf_counter()

        async def one(i: int) -> RolloutResult:
            async with orch.semaphore:
                sampling = sampling_args(
                    c.sampling, seed=request_seed(c.seed, -1, i), max_tokens=c.bench_config.max_tokens
                )
                return await runner.rollout(i, client=orch.client_for(i), model=orch.served_model, sampling=sampling)

        results = await asyncio.gather(*(one(i) for i in range(c.bench_config.num_requests)))
        wall = time.perf_counter() - t0
    finally:
        await runner.close()
        await orch.semaphore.aclose()
    tokens = sum(r.completion_len for r in results)
    report = {
        "num_requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "latency_mean_s": float(np.mean([r.latency for r in results])),
        "failed": sum(r.failed for r in results),
        "max_concurrent": c.client.max_concurrent,
    }
    atomic_write_json(orch.run_dir.root / "bench" / "orchestrator.json", report)
    return report
