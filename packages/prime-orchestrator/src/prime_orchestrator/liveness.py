"""The orchestrator's side of liveness: what it reports while rollouts run, which rollouts it refuses to train on, and
when a step has too few good rollouts to go on.

``RolloutTracker`` keeps the ``rollouts`` lane of the progress file (``prime_core.progress``) current: which steps are
generating, how many rollouts are done, when the last one finished (the watchdog's clock for the lane, bounded by the
longest rollout timeout), and counts done, failed and retried rollouts per environment. ``screen`` turns a rollout whose
reward or metrics are not finite into a failed one and cuts its log text. ``check_step`` stops the run (one line naming
the environments and the first error) when fewer than ``recovery.min_ok_fraction`` of a step's rollouts succeeded.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from prime_core import progress
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.rollout import RolloutResult

from prime_orchestrator.sample_checks import check_sequences, vocab_size

T = TypeVar("T")
LANE = "rollouts"


class RolloutsFailed(RuntimeError):
    """Too few rollouts of a step succeeded to train on; the message is one line."""


class RolloutTracker:
    """In-flight rollouts per step, for the progress file's ``rollouts`` lane and the per-environment counters."""

    def __init__(self, config: OrchestratorConfig):
        self.config = config
        env_timeouts = [e.rollout_timeout for e in (*config.env, *config.eval.envs)]
        # A rollout ends within its timeout; one re-run after its env server was replaced gets a fresh one, and the
        # replacement itself is bounded by the probe timeout and the server's start.
        self.limit_s = max(env_timeouts) + config.recovery.probe_timeout_s
        self.pending: Counter[int] = Counter()
        self.done: Counter[int] = Counter()
        self.vocab = vocab_size(config.model.name)

    def _describe(self) -> str:
        steps = sorted(self.pending)
        parts = [f"{self.done[s]} of {self.done[s] + self.pending[s]} done for step {s}" for s in steps]
        return "generating rollouts (" + ", ".join(parts) + ")"

    async def track(self, step: int, rollout: Awaitable[T]) -> T:
        """Await one rollout of ``step``; the lane shows it in flight until it finishes."""
        if not self.pending:
            self.pending[step] += 1
            progress.begin(self._describe(), lane=LANE, limit_s=self.limit_s)
        else:  # more work in flight is no progress: the lane's clock runs on until a rollout finishes
            self.pending[step] += 1
            progress.describe(LANE, self._describe())
        try:
            result = await rollout
        finally:
            self.pending[step] -= 1
            self.done[step] += 1
            if self.pending[step] == 0:
                del self.pending[step], self.done[step]
            if self.pending:
                progress.touch(LANE, self._describe())
            else:
                progress.end(LANE)
        return result

    def screen(self, result: RolloutResult, server: str) -> RolloutResult:
        """`screen`, and a rollout whose tokens ``server`` sampled hold a value no policy samples fails, naming it."""
        if not result.failed and (bad := check_sequences(result, vocab=self.vocab)):
            error = f"inference server {server} answered {bad}"
            result = RolloutResult(
                env=result.env, example=result.example, failed=True, error=error, latency=result.latency
            )
        return screen(result, self.config.recovery.max_text_chars)

    def record(self, result: RolloutResult) -> RolloutResult:
        """Count a finished rollout of its environment (done, failed) in the progress file."""
        progress.count(f"rollouts/{result.env}/done")
        if result.failed:
            progress.count(f"rollouts/{result.env}/failed")
        return result


class InflightLane:
    """Requests in flight as one lane of the progress file (eval rollouts, teacher scoring): it begins with the first,
    its clock restarts when one finishes (never when one starts), and it ends with the last. ``limit_s`` is the longest
    one request may take, so a lane past it is a process that stopped making progress."""

    def __init__(self, lane: str, what: str, limit_s: float):
        self.lane, self.what, self.limit_s = lane, what, limit_s
        self.pending = self.done = 0

    def _describe(self) -> str:
        return f"{self.what} ({self.done} of {self.done + self.pending} done)"

    async def track(self, request: Awaitable[T]) -> T:
        self.pending += 1
        if self.pending == 1:
            progress.begin(self._describe(), lane=self.lane, limit_s=self.limit_s)
        else:
            progress.describe(self.lane, self._describe())
        try:
            return await request
        finally:
            self.pending -= 1
            self.done += 1
            if self.pending:
                progress.touch(self.lane, self._describe())
            else:
                progress.end(self.lane)
                self.done = 0


def ship_activity(config: OrchestratorConfig, step: int) -> contextlib.AbstractContextManager[None]:
    """The ``ship`` lane while a step is packed and sent: the zmq transport blocks until the trainer takes it (a
    wait on the trainer), files never wait (a bound learned from earlier steps)."""
    waits: dict[str, str] = {"waits_for": "trainer"} if config.transport.type == "zmq" else {"kind": "ship"}
    return progress.activity(f"packing and sending step {step}", lane="ship", **waits)


def screen(result: RolloutResult, max_text_chars: int) -> RolloutResult:
    """A rollout the trainer may use: a reward (a seat's too) or metric that is not finite fails it (it would poison the
    group's advantages); prompt and completion text, kept only for log tables, are cut to ``max_text_chars``."""
    if result.failed:  # what verifiers recorded before the failure only counts in the summaries, where finite
        return result if not_finite(result) is None else result.model_copy(update={"metrics": {}, "traces": []})
    if (error := not_finite(result)) is not None:
        return RolloutResult(env=result.env, example=result.example, failed=True, error=error, latency=result.latency)
    if len(result.prompt) > max_text_chars or len(result.completion) > max_text_chars:
        cut = {k: _cut(getattr(result, k), max_text_chars) for k in ("prompt", "completion")}
        return result.model_copy(update=cut)
    return result


def not_finite(result: RolloutResult) -> str | None:
    """What of a rollout's reward, seats' rewards and metrics is not finite (``not finite: reward = nan``), or None."""
    # A seat's reward is named only where it differs from the rollout's (a single-seat env's is the same value).
    seats = {f"reward of seat {t.seat}": t.reward for t in result.traces if not _same(t.reward, result.reward)}
    values = {"reward": result.reward, **seats, **result.metrics}
    bad = [name for name, value in values.items() if not math.isfinite(value)]
    return "not finite: " + ", ".join(f"{name} = {values[name]}" for name in bad[:4]) if bad else None


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def check_step(step: int, results: Iterable[RolloutResult], min_ok_fraction: float) -> None:
    """Raise ``RolloutsFailed`` when fewer than ``min_ok_fraction`` of the step's rollouts succeeded."""
    results = list(results)
    failed = [r for r in results if r.failed]
    if not results or len(results) - len(failed) >= min_ok_fraction * len(results):
        return
    by_env = Counter(r.env for r in failed)
    envs = ", ".join(f"{env}: {n}" for env, n in by_env.most_common())
    first = failed[0].error or "no error recorded"
    raise RolloutsFailed(
        f"step {step}: {len(failed)} of {len(results)} rollouts failed ({envs}), more than "
        f"orchestrator.recovery.min_ok_fraction = {min_ok_fraction:g} allows; first error: {first}"
    )


def env_metrics(results: Iterable[RolloutResult], pools: dict[str, Any]) -> dict[str, float]:
    """Per environment: the step's failed rollouts, and the run's env-server replacements, re-run rollouts, trace
    fields dropped past ``recovery.max_answer_mb`` and rollouts whose answer could not be packed (``answer_cap``)."""
    metrics: dict[str, float] = {}
    failed = Counter(r.env for r in results if r.failed)
    for name, pool in pools.items():
        metrics[f"failed/{name}"] = failed.get(name, 0)
        metrics[f"env_servers/{name}/restarts"] = pool.server.num_restarts
        metrics[f"env_servers/{name}/retries"] = pool.num_retries
        metrics[f"env_servers/{name}/dropped_fields"] = pool.server.num_dropped_fields
        metrics[f"env_servers/{name}/unsendable"] = pool.server.num_unsendable
    return metrics


def report_env_servers(pools: dict[str, Any]) -> None:
    """Each env server's replacements and re-run rollouts, in every heartbeat of the orchestrator."""

    def counters() -> dict[str, float]:
        found: dict[str, float] = {}
        for name, pool in list(pools.items()):
            found[f"env_servers/{name}/restarts"] = pool.server.num_restarts
            found[f"env_servers/{name}/retries"] = pool.num_retries
        return found

    progress.current().add_counters(counters)
