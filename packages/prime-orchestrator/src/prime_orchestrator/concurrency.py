"""How many rollouts are in flight: ``async with limiter:`` around each one, like an ``asyncio.Semaphore`` whose size
follows the inference engines' own load (``client.concurrency = "adaptive"``) or stays ``client.max_concurrent``.

The limiter polls every server's ``/health`` (`prime_core.schemas.health`: KV-cache usage, requests waiting,
cumulative preemptions) every ``client.load_poll_interval`` seconds, each request bounded by the same interval, and
`AdaptiveController` moves the limit:

- **back off** when a server preempted a request since the last poll (its cache overflowed: the evicted request
  re-runs its prefill later), halving the limit; or, more gently, when a cache is full (usage at or above the target)
  while requests wait for room in it. Once cut, the limit is not cut again before the rollouts in flight have come
  down to it: the preemptions until then are the old limit's.
- **grow** (by half, at most to what the usage projects to the target) while every cache is below
  ``client.target_kv_usage``, no request waits at any server, and rollouts wait at the limiter for a slot (the limit
  is what holds them back).
- otherwise, and whenever a server did not answer or reports no KV-cache usage, hold.

``max_concurrent`` is the ceiling. A rollout already in flight is never interrupted: a lower limit only holds new
ones back. With ``fixed`` the limit stays ``max_concurrent``; the polls still run, for the ``engine/*`` metrics.

With continuous rollouts (``max_off_policy_steps``) the KV cache is not the only thing that makes more rollouts in
flight useless: each rollout in flight shares the engine's decode steps, so the more there are, the more batches the
trainer consumes while a long one decodes, and past some count the longest rollouts outlive the staleness bound and are
thrown away. `StalenessCap` is a second ceiling for that, moved once per formed batch by the scheduler: it backs off
when the batch dropped stale rollouts and grows back after batches that dropped none (see its docstring).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from prime_core.config.orchestrator import ClientConfig
from prime_core.schemas.health import HealthResponse, parse_health

from prime_orchestrator.client import WeightUpdateError

if TYPE_CHECKING:
    from prime_orchestrator.weight_relay import Policy

logger = logging.getLogger("prime.orchestrator.concurrency")

LoadSource = Callable[[], Awaitable[list[HealthResponse | None]]]
"""One poll: every server's /health, in ``base_urls`` order; None for a server that did not answer in time."""


@dataclass(frozen=True)
class EngineLoad:
    """The servers' load at one poll, summed (usage: the fullest cache, the one that overflows first)."""

    kv_cache_usage: float
    waiting: int
    preemptions: int
    """Cumulative over the servers."""
    new_preemptions: int
    """Since the previous poll."""


class AdaptiveController:
    """The limit's next value from the engines' load (rules in the module docstring)."""

    def __init__(self, *, ceiling: int, target_kv_usage: float, growth: float = 1.5, backoff: float = 0.5,
                 trim: float = 0.9, floor: int = 1):  # fmt: skip
        self.ceiling, self.target, self.floor = ceiling, target_kv_usage, min(floor, ceiling)
        self.growth, self.backoff, self.trim = growth, backoff, trim

    def update(self, limit: int, load: EngineLoad, *, in_flight: int, queued: int, cap: int | None = None) -> int:
        """``cap``: a lower ceiling for now (`StalenessCap`); a limit above it comes down to it at once."""
        ceiling = self.ceiling if cap is None else max(self.floor, min(self.ceiling, cap))
        if limit > ceiling:
            return ceiling
        full = load.kv_cache_usage >= self.target and load.waiting > 0
        if load.new_preemptions > 0 or full:
            if in_flight > limit:  # the last cut has not taken effect yet
                return limit
            return max(self.floor, math.floor(limit * (self.backoff if load.new_preemptions > 0 else self.trim)))
        if load.kv_cache_usage < self.target and load.waiting == 0 and queued > 0 and in_flight >= limit:
            grown = limit * self.growth
            if load.kv_cache_usage > 0:
                # Usage grows about linearly with the requests in flight: stop near the target.
                grown = min(grown, limit * self.target / load.kv_cache_usage)
            return min(ceiling, max(limit + 1, math.floor(grown)))
        return limit


class StalenessCap:
    """Continuous mode's ceiling on rollouts in flight, so that they finish within ``max_off_policy_steps`` = K.

    While a rollout of L tokens decodes, about ``in_flight`` x L tokens are sampled; the trainer consumes a batch per
    ``batch_tokens`` of them, so the rollout trains within K steps of its first token only if
    ``in_flight <= K x batch_tokens / L``: ``safe`` for the longest rollout of the last few batches. Above it the
    longest rollouts may or may not make it (the count in flight falls as a step's rollouts finish), so the cap is
    found by the outcome, additive-increase / multiplicative-decrease on the stale drops of each formed batch:

    - a batch whose formation dropped or cancelled stale rollouts cuts the cap to ``backoff`` x the most rollouts
      that were in flight since the previous batch (what caused the drops), never below ``safe``;
    - a batch without drops lets the cap grow by ``growth`` of a batch's rollouts, up to the limiter's ceiling.
    """

    def __init__(self, *, ceiling: int, bound: int, batch_size: int, group_size: int, backoff: float = 0.75,
                 growth: float = 0.125, window: int = 4):  # fmt: skip
        self.ceiling, self.bound, self.batch_size = ceiling, max(bound, 1), batch_size
        self.floor = min(group_size, ceiling)
        self.backoff, self.step = backoff, max(group_size, math.ceil(growth * batch_size))
        self.value = ceiling
        self.safe = self.floor
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)

    def update(self, *, dropped: int, peak_in_flight: int, batch_tokens: int, longest: int) -> int:
        """The cap after a batch was formed: ``dropped`` stale rollouts since the previous one, at most
        ``peak_in_flight`` in flight meanwhile; the batch held ``batch_tokens`` completion tokens; ``longest`` is the
        longest completion that finished meanwhile."""
        self._recent.append((batch_tokens, longest))
        tokens = sum(t for t, _ in self._recent) / len(self._recent)
        longest_recent = max(n for _, n in self._recent)
        if longest_recent > 0:
            self.safe = min(self.ceiling, max(self.floor, math.floor(self.bound * tokens / longest_recent)))
        if dropped > 0:
            self.value = max(self.safe, math.floor(min(self.value, max(peak_in_flight, 1)) * self.backoff))
        else:
            self.value = min(self.ceiling, self.value + self.step)
        return self.value


class ServerChanged(WeightUpdateError):
    """A server's /health says it is not the server the run loaded its weights into: another run's, or one whose
    weight step went back (a restart or reload behind the relay's back). The message is one line naming it; a
    `WeightUpdateError`, so the entry point ends the run on that line (whichever of the poll and the relay's check
    sees the server first)."""


class HealthPoller:
    """A `LoadSource` over HTTP: every server's /health at once, each request bounded by the poll interval. An answer
    with another run's ``run_id`` (``client.server_run_id``) or a weight step below one it reported before raises
    `ServerChanged`: every rollout it samples from then on would be counted as the relay's policy. A server whose
    vLLM engines died in part (its ``dead_engines``; it serves on with the others) is a warning, once per engine."""

    def __init__(self, client: ClientConfig):
        self.urls = [u.rstrip("/") + "/health" for u in client.base_urls]
        self.run_id = client.server_run_id
        self.steps: dict[str, int] = {}
        self.dead: dict[str, set[int]] = {}
        self._polls = 0
        self._served: tuple[int, int] | None = None  # (step the relay loaded, the first poll started after it)
        self.timeout = max(client.load_poll_interval, 0.5)
        key = client.resolved_api_key()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http: httpx.AsyncClient | None = None  # made in the running loop, at the first poll

    def served(self, step: int) -> None:
        """The relay loaded weights ``step`` into every server: an answer to a later poll below it is a restart. Without
        this, a server restarted within a poll interval of the load (a tiny model's steps take less) was never seen
        at the step it went back from, and its rollouts counted as the relay's policy until the next load, or for
        good. Polls already on the way may still answer the step before (they left before the load ended)."""
        self._served = (max(step, self._served[0] if self._served else step), self._polls + 1)

    async def __call__(self) -> list[HealthResponse | None]:
        if self._http is None:
            self._http = httpx.AsyncClient(headers=self.headers)
        self._polls += 1
        poll = self._polls
        answers = list(await asyncio.gather(*(self._one(self._http, u) for u in self.urls)))
        for url, health in zip(self.urls, answers, strict=True):
            self._check(url.removesuffix("/health"), health, poll)
        return answers

    def _check(self, url: str, health: HealthResponse | None, poll: int = 0) -> None:
        if health is None:
            return
        if self.run_id is not None and health.run_id != self.run_id:
            raise ServerChanged(f"inference server {url} now answers /health for run {health.run_id!r}, not this "
                                f"run ({self.run_id!r}): another server took its place")  # fmt: skip
        before, step = self.steps.get(url), health.weight_step
        if self._served is not None and poll >= self._served[1]:
            before = max(before or 0, self._served[0])
        if step is not None and before is not None and step < before:
            raise ServerChanged(f"inference server {url} now serves weights step {step} after step {before} (it "
                                "restarted or reloaded its weights); its rollouts' versions cannot be vouched for")  # fmt: skip
        if step is not None:
            self.steps[url] = max(step, before or 0)
        dead = (health.model_extra or {}).get("dead_engines") or []
        if new := set(dead) - self.dead.setdefault(url, set()):
            self.dead[url] |= new
            engines = (health.model_extra or {}).get("engines", "?")
            rest = "it serves nothing" if engines == len(self.dead[url]) else "it serves with the others (slower)"
            logger.warning("inference server %s: vLLM engine(s) %s of %s died; %s", url,
                           ", ".join(map(str, sorted(new))), engines, rest)  # fmt: skip

    async def _one(self, http: httpx.AsyncClient, url: str) -> HealthResponse | None:
        try:
            async with asyncio.timeout(self.timeout):  # as a whole: a trickled answer must not hold the poll
                response = await http.get(url, timeout=self.timeout)
            return parse_health(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, TimeoutError):
            return None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


class ConcurrencyLimiter:
    """``async with limiter:`` admits a rollout while fewer than ``limit`` are in flight, first come first served."""

    def __init__(self, limit: int, *, load: LoadSource | None = None, controller: AdaptiveController | None = None,
                 interval_s: float = 1.0, close_load: Callable[[], Awaitable[None]] | None = None):  # fmt: skip
        self.limit = limit
        self.in_flight = 0
        self.load, self.controller, self.interval_s, self._close_load = load, controller, interval_s, close_load
        self.last: EngineLoad | None = None
        self.cap: int | None = None
        """A lower ceiling that the continuous scheduler sets (`StalenessCap`); adaptive concurrency only."""
        self.peak_in_flight = 0
        """The most rollouts in flight since `take_peak` last read it."""
        self._preemptions: list[int | None] = []
        self._new_preemptions = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._task: asyncio.Task | None = None
        self.fault: ServerChanged | None = None
        """Raised to every rollout that asks for a slot once a poll found it, and by `raise_fault`: the run stops on
        its one line."""
        self._fault_found = asyncio.Event()

    @classmethod
    def from_config(cls, client: ClientConfig, policy: Policy | None = None) -> ConcurrencyLimiter:
        """``policy``: the relay's, whose every load the poll learns (`HealthPoller.served`); None where the servers'
        /health does not report the relay's steps (a LoRA run's reports its base's, 0)."""
        assert client.max_concurrent is not None  # ClientConfig fills it in
        poll = HealthPoller(client)
        if policy is not None:
            policy.listeners.append(lambda: poll.served(policy.version))
        controller = None
        if client.concurrency == "adaptive":
            controller = AdaptiveController(ceiling=client.max_concurrent, target_kv_usage=client.target_kv_usage)
        start = min(client.initial_concurrent, client.max_concurrent) if controller else client.max_concurrent
        return cls(
            start, load=poll, controller=controller, interval_s=client.load_poll_interval, close_load=poll.aclose
        )

    # ----- the semaphore -----
    async def __aenter__(self) -> ConcurrencyLimiter:
        if self.fault is not None:
            raise self.fault
        self._start_polling()
        if self.in_flight < self.limit and not self._waiters:
            self._occupy()
            return self
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # admitted, then cancelled before it ran: hand the slot on
            else:
                self._waiters.remove(waiter)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._occupy()
                waiter.set_result(None)

    def _occupy(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def take_peak(self) -> int:
        """The most rollouts in flight since the previous call (the count now starts the next period)."""
        peak, self.peak_in_flight = self.peak_in_flight, self.in_flight
        return peak

    @property
    def queued(self) -> int:
        """Rollouts waiting for a slot."""
        return sum(not w.done() for w in self._waiters)

    def set_cap(self, cap: int) -> None:
        """Continuous mode's staleness ceiling (`StalenessCap`): applies to adaptive concurrency only (a ``fixed``
        count is the user's), at once when the limit is above it, else at the next poll's growth."""
        if self.controller is None:
            return
        self.cap = cap
        if self.limit > cap:
            logger.info("concurrency limit %d -> %d: rollouts dropped as stale", self.limit, max(cap, 1))
            self.set_limit(max(cap, 1))

    def set_limit(self, limit: int) -> None:
        if limit != self.limit:
            logger.debug("concurrency limit %d -> %d (%d in flight, %d queued)", self.limit, limit, self.in_flight,
                         self.queued)  # fmt: skip
        self.limit = limit
        self._admit()

    # ----- the engines' load -----
    def _start_polling(self) -> None:
        if self._task is None and self.load is not None:
            self._task = asyncio.create_task(self._poll_loop(), name="concurrency-limiter")

    async def _poll_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except ServerChanged as e:
                logger.error("%s", e)
                self.fault = e
                self._fault_found.set()
                for waiter in self._waiters:
                    if not waiter.done():
                        waiter.set_exception(e)
                return
            except Exception:  # the limit must never take the run down: it holds instead
                logger.exception("reading the inference servers' load failed; the concurrency limit holds")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def raise_fault(self) -> None:
        """Never returns: raises the `ServerChanged` a poll found, as soon as it is found. While the orchestrator waits
        for the trainer no rollout asks for a slot, and a server restarted then stayed unnamed until the next weights
        came (and, where the relay loaded them first, for good)."""
        await self._fault_found.wait()
        assert self.fault is not None
        raise self.fault

    async def poll_once(self) -> EngineLoad | None:
        """Poll every server once and move the limit; None (limit unchanged) unless every server reported its load."""
        assert self.load is not None
        answers = await self.load()
        self._count_preemptions(answers)
        if any(a is None or a.kv_cache_usage is None for a in answers):
            return None
        load = EngineLoad(
            kv_cache_usage=max(a.kv_cache_usage for a in answers),  # type: ignore[union-attr, type-var]
            waiting=sum(a.waiting for a in answers),  # type: ignore[union-attr]
            preemptions=sum(a.preemptions or 0 for a in answers),  # type: ignore[union-attr]
            new_preemptions=self._new_preemptions,
        )
        self.last, self._new_preemptions = load, 0
        if self.controller is not None:
            limit = self.controller.update(self.limit, load, in_flight=self.in_flight, queued=self.queued, cap=self.cap)
            if limit < self.limit:
                why = f"{load.new_preemptions} preemption(s)" if load.new_preemptions else (
                    f"KV cache {load.kv_cache_usage:.0%} full, {load.waiting} request(s) waiting")  # fmt: skip
                logger.info("concurrency limit %d -> %d: %s", self.limit, limit, why)
            self.set_limit(limit)
        return load

    def _count_preemptions(self, answers: list[HealthResponse | None]) -> None:
        """Add each server's new preemptions to those not yet acted on (a poll where some server is silent acts on
        nothing, and the next complete one sees them)."""
        if len(self._preemptions) != len(answers):
            self._preemptions = [None] * len(answers)
        for i, answer in enumerate(answers):
            count, before = (answer.preemptions if answer is not None else None), self._preemptions[i]
            if count is None:
                continue
            # A restarted server counts from 0 again: a new baseline, nothing new.
            if before is not None and count > before:
                self._new_preemptions += count - before
            self._preemptions[i] = count

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {"concurrency/limit": self.limit, "concurrency/in_flight": self.in_flight}
        if self.cap is not None:
            m["concurrency/staleness_cap"] = self.cap
        if self.last is not None:
            m.update({"engine/kv_cache_usage": self.last.kv_cache_usage, "engine/waiting": self.last.waiting,
                      "engine/preemptions": self.last.preemptions})  # fmt: skip
        return m

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._close_load is not None:
            await self._close_load()
