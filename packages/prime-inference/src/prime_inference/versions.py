"""The version ledger: which weight steps sampled the tokens of each tagged rollout (``POST /rollout_versions``).

With in-flight weight updates a request may span several weight steps. The orchestrator tags every request of a
rollout (``prime_core.schemas.rollout.ROLLOUT_TAG`` in ``sampling_params.extra_args``, which verifiers' train client
passes through); the token-in route records here, per tag, the step of the first and last sampled token as the
engine's outputs come in. An engine whose outputs are live (`Engine.live_versions`, the torch engine) gives each
token's step as it is sampled: a tag without a record has sampled nothing yet. Otherwise (vLLM's final-only outputs)
a request that starts opens the record with the step served then, a bound the finished request's values replace.

The orchestrator reads the record while a rollout runs (is it already too stale to train?), pops it when the
rollout ends, and can abort a stale rollout's requests. A popped tag is remembered (the last ``MAX_RELEASED``): a
request of it that still runs, or arrives late, records nothing. Every coroutine here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from prime_core.schemas.rollout import (
    MIN_WEIGHT_STEP,
    ROLLOUT_TAG,
    PolicyVersions,
    RolloutVersionsRequest,
    RolloutVersionsResponse,
)

from prime_inference.engines.base import Engine, EngineOutput
from prime_inference.protocol import RequestError

T = TypeVar("T")
MAX_TAGS = 65536
"""Records kept; the oldest goes first (a client that never pops cannot grow the server's memory)."""
MAX_RELEASED = 16384
"""Popped tags remembered (the oldest forgotten first): a request of one still running or still on its way (a failed
rollout's, popped as it failed) must not record it again. ~140 bytes each with the orchestrator's tags: 2.3 MB."""


def rollout_tag(extra_args: dict[str, Any] | None) -> str | None:
    tag = (extra_args or {}).get(ROLLOUT_TAG)
    if tag is not None and (not isinstance(tag, str) or not 0 < len(tag) <= 256):
        raise RequestError(f"extra_args.{ROLLOUT_TAG} must be a string of 1 to 256 characters", param="extra_args")
    return tag


def min_weight_step(extra_args: dict[str, Any] | None) -> int | None:
    step = (extra_args or {}).get(MIN_WEIGHT_STEP)
    if step is not None and (type(step) is not int or step < 0):
        raise RequestError(f"extra_args.{MIN_WEIGHT_STEP} must be a weight step (an integer >= 0)", param="extra_args")
    return step


class WeightGate:
    """Holds a request that names the oldest weights it accepts until the engine serves them. The orchestrator sends a
    step's rollouts before that step's weights land (``dispatch_ahead``), so their env side (prompts, tokenizing,
    requests on the way) is done while the previous weights still serve, and they all start the moment the update
    does. Weight changes wake the waiters (``changed``); a 1 s recheck covers any change that did not."""

    def __init__(self):
        self._changed = asyncio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, engine: Engine, step: int | None, timeout: float) -> None:
        if step is None or engine.info.weight_step >= step:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        while engine.info.weight_step < step:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise RequestError(
                    f"waited {timeout:g} s for weights step {step} (extra_args.{MIN_WEIGHT_STEP}); this server serves "
                    f"step {engine.info.weight_step} (server.weight_wait_timeout)",
                    status_code=503,
                    param="extra_args",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))


class VersionLedger:
    def __init__(self, max_tags: int = MAX_TAGS, max_released: int = MAX_RELEASED):
        self.max_tags, self.max_released = max_tags, max_released
        self.records: collections.OrderedDict[str, PolicyVersions] = collections.OrderedDict()
        self.released: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Tags popped: their rollout ended (or failed, or was aborted); a record of one is never made again. Before,
        a failed rollout's request still generating when the orchestrator popped its record made it again, and it
        stayed until the cap pushed it out (65,536 records of ~614 bytes)."""
        self.running: dict[str, set[asyncio.Task]] = {}
        self.aborted: set[asyncio.Task] = set()

    def _put(self, tag: str, record: PolicyVersions) -> None:
        if tag in self.released:
            return
        self.records[tag] = record
        self.records.move_to_end(tag)
        while len(self.records) > self.max_tags:
            self.records.popitem(last=False)

    def begin(self, tag: str, step: int) -> None:
        """A request of ``tag`` starts on an engine without live outputs: until it reports, its tokens were sampled
        with ``step`` or newer."""
        if tag not in self.records:
            self._put(tag, PolicyVersions(first=step, last=step, num_tokens=0, exact=False))

    def record(self, tag: str, out: EngineOutput) -> None:
        if out.weight_step is None or not out.token_ids:
            return
        steps = out.weight_steps or [out.weight_step]
        first, last, n = min(steps), max(steps), len(out.token_ids)
        old = self.records.get(tag)
        if old is not None and old.num_tokens > 0:  # not a placeholder of `begin`: widen it
            first, last = min(first, old.first), max(last, old.last)
            n += old.num_tokens
        exact = out.versions_exact and (old is None or old.num_tokens == 0 or old.exact)
        self._put(tag, PolicyVersions(first=first, last=last, num_tokens=n, exact=exact))

    async def run(self, tag: str | None, work: Awaitable[T]) -> T:
        """Await ``work`` (a request's generation), abortable through ``abort`` when it carries a tag."""
        if tag is None:
            return await work
        task = asyncio.ensure_future(work)
        self.running.setdefault(tag, set()).add(task)
        try:
            return await task  # cancelling the route cancels the task too
        except asyncio.CancelledError:
            if task in self.aborted:
                raise RequestError(f"rollout {tag} was aborted (stale)", status_code=409) from None
            raise
        finally:
            self.aborted.discard(task)
            tasks = self.running.get(tag)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self.running[tag]

    def query(self, req: RolloutVersionsRequest) -> RolloutVersionsResponse:
        aborted = 0
        if req.abort:
            for tag in req.tags:
                for task in self.running.get(tag, ()):
                    if not task.done():
                        self.aborted.add(task)
                        task.cancel()
                        aborted += 1
        found = {t: self.records[t] for t in req.tags if t in self.records}
        if req.pop:
            for tag in req.tags:
                self.records.pop(tag, None)
                self.released[tag] = None
                self.released.move_to_end(tag)
            while len(self.released) > self.max_released:
                self.released.popitem(last=False)
        return RolloutVersionsResponse(versions=found, aborted=aborted)
