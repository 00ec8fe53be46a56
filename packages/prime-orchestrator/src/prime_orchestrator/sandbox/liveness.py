"""The sandbox pool's heartbeat, for the watchdogs of a run (docs/liveness.md).

A pool lives in the process that scores rollouts (an env-server worker, through ``run``/``arun`` or the
``sandbox_pool`` runtime). Inside a run (``PRIME_PROGRESS_DIR`` set by the orchestrator) it writes
``progress/sandbox_pool_<pid>.json`` once a second: its counters (``SandboxHealth``) and, while executions run, one
activity whose clock restarts each time an execution ends. Its bound is the longest one execution may take through
the pool's own recovery (a hung zygote found and replaced, the request sent again, the wall limit and the verdict's
slack), so an activity past it means the pool itself stopped (its event loop blocked, a bug): the orchestrator's env
watch then replaces the env server holding it, and the launcher's watchdog, ``slack_s`` later, stops the run if
nobody did. Zygotes that die or hang are the pool's own business (``SandboxPool``), counted in ``zygotes_replaced``.
"""

from __future__ import annotations

from collections.abc import Callable

from prime_core import progress
from prime_core.config.sandbox import SandboxPoolConfig

from prime_orchestrator.sandbox.schemas import SandboxHealth

KIND = "sandbox_pool"
LANE = "executions"
REAP_WAIT_S = 10.0
"""How long the pool waits for a retired zygote's pipe, or a killed execution's, to close (``ResultPipe.wait_eof``)."""


class PoolProgress:
    """Running executions as the ``executions`` lane of the pool's progress file; a no-op outside a run."""

    def __init__(self, config: SandboxPoolConfig, health: Callable[[], SandboxHealth], verdict_slack_s: float):
        self.config = config
        self.health = health
        self.verdict_slack_s = verdict_slack_s
        self.reporter = progress.helper_reporter(KIND)
        self._walls: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return self.reporter.enabled

    def start(self) -> None:
        if self.enabled:
            self.reporter.add_counters(self._counters)
            self.reporter.start()

    def _counters(self) -> dict[str, float]:
        h = self.health()
        return {
            "zygotes": h.zygotes,
            "zygotes_replaced": h.zygotes_replaced,
            "executions_completed": h.executions_completed,
            "sandbox_errors": h.sandbox_errors,
            "running": h.running,
        }

    def bound_s(self) -> float:
        """Longest one execution may take from its hand-off to its verdict: two attempts, each a zygote started and
        found hung, then the wall limit and the verdict's slack, and the reaping of what was killed."""
        c = self.config
        attempt = c.start_timeout_s + c.hang_timeout_s + REAP_WAIT_S
        return 2 * attempt + max(self._walls.values(), default=c.limits.wall_s) + self.verdict_slack_s + REAP_WAIT_S

    def _what(self) -> str:
        return f"running {len(self._walls)} sandbox execution(s)"

    def started(self, key: int, wall_s: float) -> None:
        """Execution ``key`` was handed to the pool; more work is no progress, so the clock runs on."""
        first = not self._walls
        self._walls[key] = wall_s
        if first:
            self.reporter.begin(self._what(), lane=LANE, limit_s=self.bound_s())
        else:
            self.reporter.describe(LANE, self._what(), self.bound_s())

    def finished(self, key: int) -> None:
        """Execution ``key`` has its verdict: progress."""
        self._walls.pop(key, None)
        if self._walls:
            self.reporter.touch(LANE, self._what(), self.bound_s())
        else:
            self.reporter.end(LANE)

    def close(self) -> None:
        self.reporter.close(remove=True)
