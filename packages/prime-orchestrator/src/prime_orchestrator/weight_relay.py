"""The weight relay: watch ``weights/step_N/STABLE`` and load each new policy into every inference server."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from prime_core import progress
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.run_dir import WEIGHTS_RUN_FILE, RunDir, weights_run_id

from prime_orchestrator import client

logger = logging.getLogger("prime.orchestrator.weight_relay")


class ForeignWeights(RuntimeError):
    """Weights in the run directory that this launch's trainer did not publish (a stopped run's, another run's)."""


class Policy:
    """The weight step inference currently serves, and a way to wait for a newer one."""

    def __init__(self, config: OrchestratorConfig, run_dir: RunDir, version: int = 0):
        self.config = config
        self.run_dir = run_dir
        self.version = version
        self.num_updates = 0
        self.last_update_time = 0.0
        self.served_at = time.time()
        """Wall-clock time the served version was loaded (the loop's timeline, ``time/policy_served_at``)."""
        self._changed = asyncio.Condition()
        self.listeners: list[Callable[[], None]] = []
        """Called whenever the served version changes (continuous dispatch starts groups for the new weights)."""
        self.own_stamped = False
        """Whether a weight step stamped with this launch's ``PRIME_RUN_ID`` was seen: its trainer stamps."""

    async def load(self, step: int, source: str = "auto") -> None:
        """Make inference serve weights ``step``; ``source="filesystem"``: only what the directory holds, not a
        one-time transfer it announces (re-serving a checkpoint step on resume)."""
        c = self.config.client
        weight_dir = self.run_dir.weight_step(step).resolve()
        t0 = time.perf_counter()
        # A server that takes longer than one request's timeout is stuck: the watchdog does not wait for the retries.
        what = f"waiting for inference to load weights step {step} (client.update_weights_timeout)"
        with progress.activity(what, lane="relay", limit_s=c.update_weights_timeout, waits_for="inference"):
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
            self.version, self.served_at = step, time.time()
            self._changed.notify_all()
        for listener in self.listeners:
            listener()

    def refuse_later_weights(self, start: int) -> None:
        """Before the run starts: weights of steps after ``start`` are a stopped launch's (a resume without
        ``prime-launch rewind``) or another run's, unless this launch's trainer stamped them (it started first): the
        relay would serve the newest of them as this run's policy. A hand-started pair shares them by exporting one
        ``PRIME_RUN_ID``."""
        own = os.environ.get("PRIME_RUN_ID")
        steps = self.run_dir.stable_weight_steps()
        later = [s for s in steps if s > start and (own is None or weights_run_id(self.run_dir.weight_step(s)) != own)]
        if later:
            raise ForeignWeights(
                f"{self.run_dir.weights} holds weights of steps {', '.join(map(str, later))} after this orchestrator's "
                f"start step {start} that this launch's trainer did not publish (a stopped run's or another run's; they "
                f"would be served as this run's policy): remove them with `prime-launch rewind --output-dir "
                f"{self.run_dir.root} --step {start}`, or choose another --output-dir"
            )

    async def resume(self, start: int) -> None:
        """Re-send the policy an uninterrupted run would serve at step ``start``: the newest stable weights <= it."""
        stable = [s for s in self.run_dir.stable_weight_steps() if s <= start]
        if start > 0 and stable and stable[-1] > 0:
            await self.load(stable[-1], source="filesystem")

    async def watch(self, poll_interval: float = 0.1) -> None:
        """Forever: relay the newest STABLE weight step when it is newer than the served one; weights another launch
        published end the run instead (``_check_stamp``)."""
        own = os.environ.get("PRIME_RUN_ID")
        while True:
            latest = self.run_dir.latest_stable_weight_step()
            if latest is not None and latest > self.version:
                if own is not None:
                    self._check_stamp(latest, own)
                await self.load(latest)
            await asyncio.sleep(poll_interval)

    def _check_stamp(self, step: int, own: str) -> None:
        """Refuse weights ``step`` stamped with another launch's id, or with none once this launch's trainer is known
        to stamp (a step in ``weights/`` carries ``own``): those are another trainer's (one started without
        ``PRIME_RUN_ID``, or older than the stamp). A hand-started pair whose trainer stamps nothing is followed."""
        path = self.run_dir.weight_step(step)
        stamp = weights_run_id(path)
        if stamp is not None and stamp != own:
            raise ForeignWeights(
                f"{path} was published by launch {stamp!r}, this orchestrator's launch is {own!r}: another run is "
                f"writing weights to {self.run_dir.root}"
            )
        if stamp is None:
            steps = self.run_dir.stable_weight_steps()
            self.own_stamped = self.own_stamped or any(
                weights_run_id(self.run_dir.weight_step(s)) == own for s in steps if s != step
            )
            if self.own_stamped:
                raise ForeignWeights(
                    f"{path} carries no launch id ({WEIGHTS_RUN_FILE}) while this launch's trainer stamps its weights "
                    f"with {own!r}: another trainer (one without PRIME_RUN_ID, or an older one) is writing weights to "
                    f"{self.run_dir.root}"
                )
        else:
            self.own_stamped = True

    async def wait_for(self, min_version: int, timeout: float) -> float:
        """Block until the served version is >= ``min_version``; returns the seconds waited.

        ``asyncio.timeout``, not ``wait_for``: Python 3.11's wait_for returns instead of raising when the cancel
        meets weights that just arrived, and the rollout loops that call this in a loop lived on after their cancel
        (the continuous one waited forever for groups nobody dispatched, holding asyncio.run's exit)."""
        t0 = time.perf_counter()
        path = self.run_dir.weight_step(min_version) / "STABLE"
        waiting = f"waiting for the trainer's weights step {min_version} ({path})"
        with progress.activity(waiting, lane="policy", waits_for="trainer"):
            try:
                async with asyncio.timeout(timeout), self._changed:
                    await self._changed.wait_for(lambda: self.version >= min_version)
            except TimeoutError as e:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for weights step {min_version} ({path}); is the trainer running?"
                ) from e
        return time.perf_counter() - t0
