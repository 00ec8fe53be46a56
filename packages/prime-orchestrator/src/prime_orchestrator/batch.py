"""What the rollout side hands the ship side: rollouts grouped by prompt, and the step batch they train in; and what
the ship side shipped (``ShippedSteps``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prime_core.schemas.rollout import RolloutResult


@dataclass
class Rollout:
    env: str
    example: int
    group: int
    weight_step: int
    """The policy version it is counted at: served when it was dispatched (step-synchronous), or the version of its
    first token (continuous)."""
    result: RolloutResult
    train: bool = True  # False: the curriculum scored the group but does not train it
    admitted: float = 0.0
    """``perf_counter`` when it took its in-flight slot (0: not recorded)."""
    done: float = 0.0
    """``perf_counter`` when its result came back."""


@dataclass
class ShippedSteps:
    """The steps shipped to the trainer in this process: one after another from the first (the resume step), so their
    count and the last are all there is to keep (a list of them grew one int a step for the whole run)."""

    count: int = 0
    last: int | None = None

    def add(self, step: int) -> None:
        self.count += 1
        self.last = step

    @property
    def first(self) -> int | None:
        return None if self.last is None else self.last - self.count + 1


@dataclass
class StepBatch:
    step: int
    groups: list[list[Rollout]]
    started: float
    wait_for_policy: float
    finished: float = 0.0
    cursors: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    """Metrics of how the batch was formed (continuous mode: the stale rollouts cancelled and dropped meanwhile)."""
    dispatched_at: float = field(default_factory=time.time)
    """Wall-clock time of dispatch: the loop's timeline lines it up with the trainer's and the weight relay's."""


def rollout_timeline(started: float, rollouts: list[Rollout]) -> dict[str, float]:
    """When a step's rollouts went out and came back, in seconds from its dispatch: the last admitted to a slot, the
    first and the median result. With ``time/rollouts`` (the last result) they say whether a step waits on
    admission, on generation or on its tail."""
    admitted = [r.admitted - started for r in rollouts if r.admitted]
    done = sorted(r.done - started for r in rollouts if r.done)
    if not admitted or not done:
        return {}
    return {
        "time/rollouts_admitted": max(admitted),
        "time/rollouts_first_done": done[0],
        "time/rollouts_half_done": done[len(done) // 2],
    }
