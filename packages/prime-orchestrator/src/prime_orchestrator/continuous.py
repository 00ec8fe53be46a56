"""Continuous rollouts (``max_off_policy_steps`` set): groups run back to back, step batches are formed from finished
groups in completion order, and no rollout trains more than ``max_off_policy_steps`` steps after its first token.

Three parts, beside the orchestrator's ship loop (which takes the batches unchanged) and weight relay:

* **Dispatch.** A group starts whenever the batches that may be formed on the served weights have room for it:
  batch n is formed only once weights n - async_level are served, so groups run for the batches up to
  ``policy.version + async_level``; each rollout still waits for a slot of the orchestrator's concurrency limit
  (``semaphore``). Each group is a draw: its environment by ratio (an RNG seeded with the seed and the draw index),
  its example by the environment's cursor, its sampling seeds by the draw index.
* **Formation.** Batch n takes finished groups oldest first: the oldest first token (``RolloutResult.versions``,
  exact from the server's version ledger) first, since it has the fewest batches left to train in, completion order
  among equals. A group is *stale* for step n when n minus the version of its oldest first token exceeds
  ``max_off_policy_steps``: staleness counts from the first token to the trainer step that consumes it, queue time
  included. A stale group is dropped whole (advantages are per group) and redrawn: its example once more, then a
  fresh draw. Until the trainer needs batch n (weights n not served yet), a group that could still train in batch
  n + 1 does not take a slot that a running *last-chance* group (one that started on weights too old for n + 1) may
  still fill: waiting costs the trainer nothing, cancelling the group would throw its work away.
* **Sweep.** Once batch n is handed to the ship loop, no later batch can take a group stale for step n + 1: queued
  ones are dropped (``off_policy/in_queue``), running ones cancelled (``off_policy/in_flight``; their requests are
  aborted at the server), each counted as a dropped group (``off_policy/dropped``). A running rollout's first
  version comes from the server's record while it runs (a rollout that sampled nothing yet cannot be stale).
* **Concurrency.** With adaptive concurrency each formed batch moves a staleness ceiling on the rollouts in flight
  (`prime_orchestrator.concurrency.StalenessCap`): down when rollouts were dropped as stale since the previous
  batch, back up after batches that dropped none.

Resume: the checkpoint of step n holds the cursors as batch n - 1 was formed, past every example drawn by then, so
a resumed run trains no example twice; the groups that were running or queued then are skipped, not replayed, and
the rollouts differ from an uninterrupted run's (completion order is timing).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prime_core import progress

from prime_orchestrator.batch import Rollout, StepBatch
from prime_orchestrator.concurrency import StalenessCap
from prime_orchestrator.envs import request_seed
from prime_orchestrator.versions import Flight

logger = logging.getLogger("prime.orchestrator.continuous")
WAKE_S = 0.5
"""Dispatch and formation re-check their condition at least this often (events wake them sooner)."""


@dataclass
class GroupRun:
    draw: int
    env: str
    example: int
    flights: list[Flight]
    redraws: int = 0
    task: asyncio.Task | None = None
    rollouts: list[Rollout] = field(default_factory=list)

    def first_version(self) -> int | None:
        """The oldest first-token version of its finished rollouts that sampled something."""
        firsts = [r.result.versions.first for r in self.rollouts if r.result.versions is not None]
        return min(firsts) if firsts else None

    def earliest_start(self) -> int | None:
        """While it runs: a lower bound of its oldest first token (a finished rollout's own, else the version its
        request went out on); None while none of its rollouts has a slot (nothing sampled)."""
        starts = [f.versions.first if f.versions is not None else f.started for f in self.flights]
        return min((v for v in starts if v is not None), default=None)


class Continuous:
    def __init__(self, orch: Any):
        self.o = orch
        c = orch.config
        self.config = c
        self.bound = c.max_off_policy_steps
        self.group_size = c.rollouts_per_example
        self.groups_per_step = c.batch_size // c.rollouts_per_example
        self.fill_step = orch.start_step
        self.draws = 0
        self.running: dict[int, GroupRun] = {}
        self.ready: deque[GroupRun] = deque()
        self.taken = 0
        self.redraw: deque[tuple[str, int, int]] = deque()
        self.counts = {"in_flight": 0, "in_queue": 0, "dropped": 0}
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        self.dispatcher: asyncio.Task | None = None
        self.last_formed = time.perf_counter()
        self.longest = 0  # the longest completion finished since the previous batch (the staleness cap's input)
        self.cap: StalenessCap | None = None
        limiter = orch.semaphore
        if limiter.controller is not None:  # adaptive concurrency: a fixed count is the user's
            self.cap = StalenessCap(ceiling=c.client.max_concurrent, bound=self.bound, batch_size=c.batch_size,
                                    group_size=self.group_size)  # fmt: skip
        orch.policy.listeners.append(self.changed.set)

    # ----- the loop -----
    async def rollout_loop(self, buffer: asyncio.Queue) -> None:
        """Form batches start_step .. max_steps - 1 and hand each to the ship loop, dispatching all along."""
        c = self.config
        self.dispatcher = asyncio.create_task(self.dispatch_loop())
        try:
            for step in range(self.o.start_step, c.max_steps):
                progress.set_step(step)
                waited = await self.o.policy.wait_for(step - c.async_level, c.weights_timeout)
                formed = asyncio.get_running_loop().create_future()
                formed.set_result(await self.form(step, waited))
                await buffer.put(formed)  # before the sweep: its lookups are no reason to keep the trainer waiting
                await self.sweep()
                self.changed.set()
            await buffer.put(None)
            await self.o.versions.abort([f for r in self.running.values() for f in r.flights if f.tag])
        finally:
            self.dispatcher.cancel()
            for run in list(self.running.values()):
                run.task.cancel()

    async def _wait(self, what: str, check: bool = True) -> None:
        """Until something changed (a group finished or was dropped, a batch formed, new weights are served) or
        ``WAKE_S`` passed; a group that failed ends the run here. ``asyncio.wait``, not ``wait_for``: Python 3.11's
        wait_for returns instead of raising when a cancel meets an event set in the same turn, and a dispatch or
        formation loop that swallowed its cancel lived on and held asyncio.run's exit forever."""
        self.changed.clear()
        changed = asyncio.ensure_future(self.changed.wait())
        try:
            done, _ = await asyncio.wait({changed}, timeout=WAKE_S)
        finally:
            changed.cancel()
        if not done:
            logger.debug("still waiting: %s", what)
        if check and self.error is not None:
            raise self.error

    # ----- dispatch -----
    def budget(self) -> int:
        """Groups that may start now: room in the batches formable on the served weights, less those under way."""
        c = self.config
        last = min(self.o.policy.version + c.async_level, c.max_steps - 1)
        room = (last - self.fill_step + 1) * self.groups_per_step
        return room - self.taken - len(self.ready) - len(self.running)

    async def dispatch_loop(self) -> None:
        while self.error is None:  # a failed group ends the run through the formation's wait
            while self.budget() > 0:
                self.start_group()
            await self._wait("room for another group", check=False)

    def draw(self) -> tuple[str, int, int]:
        """(env, example, redraws) of the next group: a stale group's example once more, else the env mix."""
        if self.redraw:
            return self.redraw.popleft()
        names = list(self.o.envs)
        rng = random.Random(f"{self.config.seed}:continuous:{self.o.start_step}:{self.draws}")
        env = rng.choices(names, weights=[self.o.envs[n].ratio for n in names])[0]
        example = self.o.cursors[env]
        self.o.cursors[env] += 1
        return env, example, 0

    def start_group(self) -> GroupRun:
        env, example, redraws = self.draw()
        g, c = self.group_size, self.config
        # Seeds by draw index; the start step keeps a resumed run's apart from the first run's.
        seeds = [request_seed(c.seed, -1 - self.o.start_step, self.draws * g + j) for j in range(g)]
        run = GroupRun(self.draws, env, example, [Flight(seed=s) for s in seeds], redraws)
        self.draws += 1
        self.running[run.draw] = run
        run.task = asyncio.create_task(self.run_group(run))
        return run

    async def run_group(self, run: GroupRun) -> None:
        step = self.fill_step
        try:
            rollouts = await asyncio.gather(
                *(
                    self.o.tracker.track(step, self.o._rollout(step, run.env, run.example, 0, j, flight))
                    for j, flight in enumerate(run.flights)
                )
            )
            # Scored for the batch being formed as it finishes (its teacher time is logged there).
            rollouts = await self.o.teachers.score(self.fill_step, run.env, list(rollouts))
        except Exception as e:  # the run stops with it, as a failed step task does in the step-synchronous loop
            self.error = e
            self.changed.set()
            raise
        for r in rollouts:  # counted at the version of its first token
            if r.result.versions is not None:
                r.weight_step = r.result.versions.first
            self.longest = max(self.longest, r.result.completion_len)
        run.rollouts = rollouts
        if self.running.pop(run.draw, None) is not None:
            self.ready.append(run)
        self.changed.set()

    # ----- staleness -----
    def stale(self, first: int | None, step: int) -> bool:
        return first is not None and step - first > self.bound

    def drop(self, run: GroupRun, where: str) -> None:
        """Count a stale group and draw its example again (once)."""
        self.counts[where] += self.group_size
        self.counts["dropped"] += 1
        if run.redraws < 1:
            self.redraw.append((run.env, run.example, run.redraws + 1))
        logger.debug("group %d (%s example %d) is stale for step %d: dropped %s", run.draw, run.env, run.example,
                     self.fill_step, where.replace("_", " "))  # fmt: skip
        self.changed.set()

    async def sweep(self) -> None:
        """Drop the queued groups and cancel the running ones that no batch from ``fill_step`` on may take."""
        step = self.fill_step
        for run in [r for r in self.ready if self.stale(r.first_version(), step)]:
            self.ready.remove(run)
            self.drop(run, "in_queue")
        cancelled = []
        for run in await self.stale_running(step):
            if self.running.pop(run.draw, None) is None:
                continue  # it finished meanwhile: the next formation judges it
            run.task.cancel()
            cancelled.append(run)
        await self.o.versions.abort([f for run in cancelled for f in run.flights if f.tag])
        for run in cancelled:
            self.drop(run, "in_flight")

    async def stale_running(self, step: int) -> list[GroupRun]:
        """The running groups that already have a rollout whose first token is too old for ``step``. The version a
        rollout started on bounds its first token's from below; only those that might be stale are looked up, all in
        one call per server."""
        stale, maybe = [], []
        for run in self.running.values():
            done = [f.versions.first for f in run.flights if f.versions is not None]
            if self.stale(min(done, default=None), step):
                stale.append(run)
                continue
            flights = [f for f in run.flights if f.versions is None and f.started is not None
                       and self.stale(f.started, step)]  # fmt: skip
            if flights:
                maybe.append((run, flights))
        if not maybe:
            return stale
        records = await self.o.versions.peek([f for _, flights in maybe for f in flights])
        for run, flights in maybe:
            # No record on that server: the bound decides. A rollout without a record has sampled nothing yet.
            firsts = [records[f.tag].first for f in flights if f.tag in records] if records is not None else [-1]
            if self.stale(min(firsts, default=None), step):
                stale.append(run)
        return stale

    # ----- formation -----
    async def form(self, step: int, waited: float) -> StepBatch:
        groups: list[list[Rollout]] = []
        while len(groups) < self.groups_per_step:
            run = self.next_ready(step, len(groups))
            if run is None:
                await self._wait(f"a finished group for step {step}")
                continue
            if self.stale(run.first_version(), step):
                self.drop(run, "in_queue")
                continue
            groups.append(run.rollouts)
            self.taken += 1
        now = time.perf_counter()
        metrics = {**self.steer_concurrency(groups), **self.step_metrics()}
        batch = StepBatch(step, groups, self.last_formed, waited, finished=now, metrics=metrics)
        self.last_formed, self.taken, self.fill_step = now, 0, step + 1
        # What an uninterrupted run has drawn when it forms the next batch (the checkpoint of step + 1 holds it).
        self.o.cursor_history[step + 1] = dict(self.o.cursors)
        return batch

    def next_ready(self, step: int, taken: int) -> GroupRun | None:
        """The finished group that batch ``step`` takes next: the oldest first token first, completion order among
        equals. None to wait: nothing is ready, or the oldest ready group could still train in the next batch while
        the slots left are held for running last-chance groups (too old for ``step + 1``)."""
        if not self.ready:
            return None
        order = [(v if (v := r.first_version()) is not None else step, i) for i, r in enumerate(self.ready)]
        version, i = min(order)
        if not self.stale(version, step + 1):
            last_chance = sum(self.stale(r.earliest_start(), step + 1) for r in self.running.values())
            if taken + last_chance >= self.groups_per_step:
                return None
        run = self.ready[i]
        del self.ready[i]
        return run

    def steer_concurrency(self, groups: list[list[Rollout]]) -> dict[str, Any]:
        """Move the staleness cap on the rollouts in flight by what this batch's formation dropped."""
        if self.cap is None:
            return {}
        peak = self.o.semaphore.take_peak()
        dropped = self.counts["in_flight"] + self.counts["in_queue"]
        tokens = sum(r.result.completion_len for g in groups for r in g)
        cap = self.cap.update(dropped=dropped, peak_in_flight=peak, batch_tokens=tokens, longest=self.longest)
        self.longest = 0
        self.o.semaphore.set_cap(cap)
        return {"concurrency/peak_in_flight": peak, "concurrency/staleness_safe": self.cap.safe}

    def step_metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {f"off_policy/{k}": v for k, v in self.counts.items()}
        m.update({"groups/running": len(self.running), "groups/queued": len(self.ready)})
        self.counts = dict.fromkeys(self.counts, 0)
        return m
