"""What the rollout side hands the ship side: rollouts grouped by prompt, and the step batch they train in."""

from __future__ import annotations

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
