"""How the orchestrator turns a group's rewards into advantages (``[orchestrator.advantage]``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prime_core.config.base import BaseConfig

__all__ = ["AdvantageConfig", "LengthPenaltyConfig"]


class LengthPenaltyConfig(BaseConfig):
    """Linear length penalty on rewards before the baseline is taken."""

    enabled: bool = False
    """Subtract ``|mean reward| * weight * len / max(len)`` from each reward of a group, then center."""
    weight: float = Field(default=0.25, ge=0)
    """Weight of the completion-length term."""


class AdvantageConfig(BaseConfig):
    """How rewards of a group become per-sample advantages (see docs/algorithms.md ## Advantages)."""

    type: Literal["grpo", "rloo", "opo"] = "grpo"
    """grpo: r - mean(r); rloo: leave-one-out baseline; opo: length-weighted mean baseline."""
    std_norm: bool = False
    """Divide by the group's reward std (+eps); off is Dr.GRPO style."""
    length_penalty: LengthPenaltyConfig = Field(default_factory=LengthPenaltyConfig)
    """Optional length penalty."""
    max_abs: float | None = Field(default=1e6, gt=0, allow_inf_nan=False)
    """Largest advantage (in absolute value) trained: a seat's group whose advantages go beyond it (a reward function
    returning 1e18) is not trained, named in a warning with its env and largest reward, and counted in
    ``filtered/overflowed_seat_groups``. Trained, such a sample alone set the step's direction (clipping the gradient
    norm, 1.5e17 for one advantage of 1e18 on the tiny test model, scaled every other sample's share to nothing), and
    from about 1e19 made the norm infinite, so the whole step was skipped. A distilling env's sequence whose per-token
    advantages go beyond it is not trained either (``filtered/overflowed_sequences``). Unset: only advantages that
    overflow float32 (what the trainer computes in)."""
