"""Advantage estimators: a group's rewards in, one advantage per sample out.

A new estimator is a named class plus a ``ADVANTAGES`` registry entry (``advantage.type`` picks it).
Formulas are in docs/algorithms.md ## Advantages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prime_core.config.orchestrator import AdvantageConfig

STD_EPS = 1e-6


class Advantage:
    """Base: ``baseline(rewards, lengths)`` per sample; the advantage is ``r_i - b_i``."""

    name: str = ""

    def baseline(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class GRPO(Advantage):
    """b = mean(r) over the group (Dr.GRPO: no std normalization unless asked)."""

    name = "grpo"

    def baseline(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.full_like(rewards, rewards.mean())


class RLOO(Advantage):
    """b_i = mean of the other G-1 rewards, so A_i = (r_i - mean(r)) * G / (G - 1)."""

    name = "rloo"

    def baseline(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        g = len(rewards)
        if g < 2:
            return rewards.copy()
        return (rewards.sum() - rewards) / (g - 1)


class OPO(Advantage):
    """b = sum(r_i * len_i) / sum(len_i): the length-weighted mean reward (optimal baseline)."""

    name = "opo"

    def baseline(self, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        total = lengths.sum()
        b = (rewards * lengths).sum() / total if total > 0 else rewards.mean()
        return np.full_like(rewards, b)


ADVANTAGES: dict[str, type[Advantage]] = {cls.name: cls for cls in (GRPO, RLOO, OPO)}


def compute_advantages(
    rewards: Sequence[float], completion_lengths: Sequence[int], config: AdvantageConfig
) -> np.ndarray:
    """Advantages of one group (same prompt), float64."""
    r = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(completion_lengths, dtype=np.float64)
    if len(r) == 0:
        return r
    if config.length_penalty.enabled and lengths.max() > 0:
        # Scaled by |mean reward| so an all-zero group stays all-zero (no gradient from length alone).
        r = r - abs(r.mean()) * config.length_penalty.weight * lengths / lengths.max()
    estimator = ADVANTAGES[config.type]()
    with np.errstate(over="ignore", invalid="ignore"):  # huge rewards overflow to inf: credit drops those groups
        adv = r - estimator.baseline(r, lengths)
        if config.std_norm:
            adv = adv / (r.std() + STD_EPS)
    if len(r) == 1:
        adv = np.zeros_like(adv)
    return adv
