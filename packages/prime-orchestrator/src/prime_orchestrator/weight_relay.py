"""The weight relay: watch ``weights/step_N/STABLE`` and load each new policy into every inference server."""

from __future__ import annotations

import asyncio
import logging
import time

from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.run_dir import RunDir

from prime_orchestrator import client

logger = logging.getLogger("prime.orchestrator.weight_relay")


class Policy:
    """The weight step inference currently serves, and a way to wait for a newer one."""

    def __init__(self, config: OrchestratorConfig, run_dir: RunDir, version: int = 0):
        self.config = config
        self.run_dir = run_dir
        self.version = version
        self.num_updates = 0
        self.last_update_time = 0.0
        self._changed = asyncio.Condition()

    async def load(self, step: int, source: str = "auto") -> None:
        """Make inference serve weights ``step``; ``source="filesystem"``: only what the directory holds, not a
        one-time transfer it announces (re-serving a checkpoint step on resume)."""
        c = self.config.client
        weight_dir = self.run_dir.weight_step(step).resolve()
        t0 = time.perf_counter()
        await client.update_weights(
            c.base_urls,
            str(weight_dir),
            step,
            api_key=c.resolved_api_key(),
            timeout=c.update_weights_timeout,
            retries=c.max_retries,
            source=source,
        )
        self.last_update_time = time.perf_counter() - t0
        self.num_updates += 1
        logger.info("inference now serves weights step %d (update took %.2fs)", step, self.last_update_time)
        async with self._changed:
            self.version = step
            self._changed.notify_all()

    async def watch(self, poll_interval: float = 0.1) -> None:
        """Forever: relay the newest STABLE weight step when it is newer than the served one."""
        while True:
            latest = self.run_dir.latest_stable_weight_step()
            if latest is not None and latest > self.version:
                await self.load(latest)
            await asyncio.sleep(poll_interval)

    async def wait_for(self, min_version: int, timeout: float) -> float:
        """Block until the served version is >= ``min_version``; returns the seconds waited."""
        t0 = time.perf_counter()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version >= min_version), timeout)
            except TimeoutError as e:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for weights step {min_version} "
                    f"({self.run_dir.weight_step(min_version)}/STABLE); is the trainer running?"
                ) from e
        return time.perf_counter() - t0
