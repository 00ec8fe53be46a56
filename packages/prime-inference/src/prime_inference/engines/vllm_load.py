"""The vLLM engine's load as ``/health`` reports it, read from vLLM's scheduler with vLLM's statistics off.

vLLM's own numbers (``SchedulerStats.kv_cache_usage``, ``num_running_reqs``, ``num_waiting_reqs``, and the preemption
events behind ``vllm:num_preemptions``) exist only with its per-step statistics on, which prime leaves off by default
(``vllm.log_stats``: they cost the server 28-37% of its throughput, docs/benchmarks.md). So this module adds one
utility method to vLLM's ``EngineCore``, which the API process calls through the engine-core client like vLLM's own
``reset_prefix_cache`` (``call_utility_async``); the engine core runs it between two steps and reads the scheduler
exactly as ``Scheduler.make_stats`` does: ``len(running)``, ``len(waiting) + len(skipped_waiting)`` and
``kv_cache_manager.usage`` (KV blocks in use over all blocks). Preemptions are counted where the scheduler makes them
(``Scheduler._preempt_request``), except those of ``reset_prefix_cache(reset_running_requests=True)``: a weight update
that recomputes the running requests' cache evicts them on purpose, which says nothing about room.

`install_probe` runs in the engine-core process through the general plugin (`prime_inference.vllm_plugin`), and in the
API process before the engine starts. `LoadPoller` asks every engine core (each data-parallel one) every ``interval_s``
in the background and keeps the answer: the ``/health`` route is synchronous and must answer at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PROBE = "prime_engine_load"
_COUNTER = "_prime_num_preemptions"
_RESETTING = "_prime_resetting_cache"


def install_probe() -> bool:
    """Give ``EngineCore`` the load probe and the scheduler its preemption counter (idempotent). False where this vLLM
    lacks what they wrap: the engine then reports no load."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if hasattr(EngineCore, PROBE):
        return True
    if not (hasattr(Scheduler, "_preempt_request") and hasattr(Scheduler, "reset_prefix_cache")):
        logger.warning("vLLM's Scheduler has no _preempt_request/reset_prefix_cache: /health reports no engine load")
        return False
    preempt, reset = Scheduler._preempt_request, Scheduler.reset_prefix_cache

    @functools.wraps(preempt)
    def counted_preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, _RESETTING, False):
            setattr(self, _COUNTER, getattr(self, _COUNTER, 0) + 1)
        return preempt(self, *args, **kwargs)

    @functools.wraps(reset)
    def uncounted_reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _RESETTING, True)
        try:
            return reset(self, *args, **kwargs)
        finally:
            setattr(self, _RESETTING, False)

    Scheduler._preempt_request = counted_preempt
    Scheduler.reset_prefix_cache = uncounted_reset
    setattr(EngineCore, PROBE, engine_load)
    return True


def install_probe_if_engine_core() -> None:
    """The general plugin's part: install where vLLM's engine core is loaded (its process imports the module before it
    loads plugins); other vLLM processes (workers, model inspection) are left alone."""
    if "vllm.v1.engine.core" in sys.modules:
        try:
            install_probe()
        except Exception:  # vLLM swallows plugin failures: say it here
            logger.exception("installing prime's engine-load probe failed: /health reports no engine load")


def engine_load(core: Any) -> dict[str, Any]:
    """The probe, an ``EngineCore`` method (``self`` is the engine core): its scheduler's load now."""
    scheduler = core.scheduler
    return {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ())),
        "kv_cache_usage": float(scheduler.kv_cache_manager.usage),
        "preemptions": int(getattr(scheduler, _COUNTER, 0)),
    }


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_cache_usage: float
    preemptions: int

    @classmethod
    def combine(cls, replies: list[dict[str, Any]]) -> EngineLoad:
        """One server's load from its data-parallel engines: counts add up; usage is their mean (equal caches)."""
        return cls(
            running=sum(int(r["running"]) for r in replies),
            waiting=sum(int(r["waiting"]) for r in replies),
            kv_cache_usage=min(1.0, max(0.0, sum(float(r["kv_cache_usage"]) for r in replies) / len(replies))),
            preemptions=sum(int(r["preemptions"]) for r in replies),
        )

    @classmethod
    def merge(cls, loads: list[EngineLoad]) -> EngineLoad:
        """The load of several engines on one server (``vllm.engines``), as `combine` adds data-parallel ones."""
        return cls.combine([vars(load) for load in loads])


class LoadPoller:
    """The last load every engine core reported, refreshed every ``interval_s`` by a background task."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.latest: EngineLoad | None = None
        self._task: asyncio.Task | None = None
        install_probe()  # this process too: a forked or in-process engine core inherits the patched classes

    def start(self, engine_cores: list[Any], on_read: Callable[[list[EngineLoad]], None] | None = None) -> None:
        """Poll these engine cores (one per engine of the server); ``on_read`` gets each reading, engine by engine."""
        self._task = asyncio.create_task(self._run(engine_cores, on_read), name="vllm-engine-load")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @staticmethod
    async def read(engine_core: Any) -> EngineLoad:
        engines = list(getattr(engine_core, "core_engines", ()))
        if len(engines) > 1:
            # The client's public call answers with the first engine's result only.
            replies = await asyncio.gather(*(engine_core._call_utility_async(PROBE, engine=e) for e in engines))
        else:
            replies = [await engine_core.call_utility_async(PROBE)]
        return EngineLoad.combine(list(replies))

    async def _run(self, engine_cores: list[Any], on_read: Callable[[list[EngineLoad]], None] | None) -> None:
        # No timeout: a probe waits for the engine core's current step (or a weight reload) to end; /health keeps the
        # last answer meanwhile, and one probe at a time never piles calls up behind a busy engine.
        while True:
            try:
                loads = list(await asyncio.gather(*(self.read(core) for core in engine_cores)))
                self.latest = loads[0] if len(loads) == 1 else EngineLoad.merge(loads)
                if on_read is not None:
                    on_read(loads)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # not installed in the engine core: it fails the same way every time
                logger.warning("vLLM's engine core did not answer prime's load probe (%s): /health reports no "
                               "KV-cache usage or preemptions", e)  # fmt: skip
                self.latest = None
                return
            await asyncio.sleep(self.interval_s)

    def fields(self, in_flight: int) -> dict[str, Any]:
        """`EngineInfo`'s load fields; before the first answer (or without the probe): requests in flight only."""
        load = self.latest
        if load is None:
            return {"running": in_flight}
        return {"running": load.running, "waiting": load.waiting, "kv_cache_usage": load.kv_cache_usage,
                "preemptions": load.preemptions}  # fmt: skip
