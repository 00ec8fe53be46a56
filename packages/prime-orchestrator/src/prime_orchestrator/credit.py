"""Per-seat credit: a group's traces -> trained samples with their own advantages, and per-seat step metrics.

A group is ``rollouts_per_example`` episodes of one task. Each trainable trace of an episode (a seat of a
multi-agent game, an attempt of a multi-attempt env) trains on its own reward; its advantage is taken against the
traces of the same seat in the group (prime-rl's per-(agent, group) baseline). Self-play, one policy in both seats
of a zero-sum game, thus trains both seats: each seat's wins against its losses, where the mean of the two payoffs
would be 0 in every episode. A single-seat env is plain GRPO over the group's rollouts.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.rollout import RolloutResult, TrainedSequence

from prime_orchestrator.advantages import compute_advantages
from prime_orchestrator.metric_keys import MetricKeyCap
from prime_orchestrator.packing import Sample
from prime_orchestrator.traces import summary_metrics

ZERO = 1e-9
logger = logging.getLogger("prime.orchestrator.credit")


@dataclass
class Unit:
    """One unit of credit: a trainable trace (or a failed rollout's zero reward for a seat)."""

    seat: str
    reward: float
    length: int
    weight_step: int
    env: str
    sequences: list[TrainedSequence] = field(default_factory=list)


def _units(group: Sequence[Any]) -> list[Unit]:
    """The group's units; ``group`` holds rollouts with ``.result``, ``.env``, ``.weight_step``. A failed rollout
    is a reward-0 unit (no tokens) for each seat the group's other rollouts show (``agent`` when none does)."""
    seats = list(dict.fromkeys(t.seat for r in group for t in r.result.traces if t.trainable)) or ["agent"]
    units = []
    for r in group:
        res: RolloutResult = r.result
        if res.failed:
            units += [Unit(seat, 0.0, 0, r.weight_step, r.env) for seat in seats]
            continue
        for t in res.traces:
            if t.trainable:
                units.append(Unit(t.seat, t.reward, t.completion_len, r.weight_step, r.env, t.sequences))
    return units


def seat_groups(group: Sequence[Any]) -> dict[str, list[Unit]]:
    """The group's units by seat, in the order seats first appear: each seat's traces across the group's rollouts,
    the set its advantages are taken over (and the curriculum scores)."""
    by_seat: dict[str, list[Unit]] = defaultdict(list)
    for unit in _units(group):
        by_seat[unit.seat].append(unit)
    return dict(by_seat)


def group_samples(
    group: Sequence[Any], config: OrchestratorConfig, teachers: Any = None
) -> tuple[list[Sample], int, int, list[float], int]:
    """(samples, seat groups filtered, seat groups overflowed, their units' advantages, sequences overflowed) of one
    group: advantages per seat, a seat whose advantages are all zero dropped when ``filters.zero_advantage_groups``
    (unless its env distils: the teacher's per-token signal remains). ``teachers``
    (``prime_orchestrator.distill.Teachers``) turns a sequence's advantage into its distillation advantages; a
    sequence whose per-token advantages overflow or pass ``advantage.max_abs`` is not trained."""
    by_seat = seat_groups(group)
    samples: list[Sample] = []
    filtered = overflowed = overflowed_sequences = 0
    advantages: list[float] = []
    for units in by_seat.values():
        adv = compute_advantages([u.reward for u in units], [u.length for u in units], config.advantage)
        finite, bound = bool(np.isfinite(adv.astype(np.float32)).all()), config.advantage.max_abs
        if not finite or (bound is not None and np.abs(adv).max() > bound):
            # Finite rewards (screened) can still be too large for their advantages: 8 rewards of 1e308 sum to inf,
            # and the trainer computes in float32. Trained, one such seat would make the whole step's gradient
            # non-finite, and the trainer would skip every other group's update with it; a finite but huge one
            # (advantage.max_abs) alone set the step's direction once the gradient norm was clipped.
            overflowed += 1
            logger.warning(
                "env %s: the advantages of seat %r %s (rewards up to %.3g): that seat of the group is not trained",
                units[0].env, units[0].seat,
                f"reach {np.abs(adv).max():.3g}, over advantage.max_abs = {bound:g}" if finite else "overflow",
                max(abs(u.reward) for u in units),
            )  # fmt: skip
            continue
        advantages += adv.tolist()
        distils = teachers is not None and teachers.distils(units[0].env)
        if config.filters.zero_advantage_groups and np.all(np.abs(adv) < ZERO) and not distils:
            filtered += 1
            continue
        for u, a in zip(units, adv, strict=True):
            for q in u.sequences:
                advantage = teachers.advantage(u.env, q, float(a)) if teachers is not None else float(a)
                if isinstance(advantage, list) and (problem := _out_of_bounds(advantage, bound)):
                    overflowed_sequences += 1
                    logger.warning("env %s: the distillation advantages of a sequence of seat %r %s: that sequence is "
                                   "not trained", u.env, u.seat, problem)  # fmt: skip
                    continue
                samples.append(
                    Sample(
                        q.token_ids, q.loss_mask, q.logprobs, advantage, u.weight_step, u.env, u.reward, images=q.images
                    )
                )
    return samples, filtered, overflowed, advantages, overflowed_sequences


def _out_of_bounds(advantages: list[float], bound: float | None) -> str | None:
    """Why a sequence's per-token advantages may not train, or None. A distillation signal is log p_teacher - log
    p_student per token: a student log-prob of -1e30 (finite, so screened in) or the teacher's -9999 floor at a high
    ``kl_weight`` made one token's advantage set the whole step's direction, as a huge group advantage does."""
    peak = float(np.abs(np.asarray(advantages, np.float64)).max(initial=0.0))
    if not np.isfinite(np.float32(peak)):
        return f"overflow ({peak:.3g})"
    if bound is not None and peak > bound:
        return f"reach {peak:.3g}, over advantage.max_abs = {bound:g}"
    return None


def step_samples(
    groups: Sequence[Sequence[Any]], config: OrchestratorConfig, teachers: Any = None
) -> tuple[list[Sample], dict[str, Any]]:
    """Samples of a step's groups: the rollouts the curriculum marks as training (``train``); a failed rollout is a
    reward-0 unit (zero_reward) or dropped (drop)."""
    samples: list[Sample] = []
    filtered_groups = filtered_seats = overflowed_seats = overflowed_sequences = 0
    advantages: list[float] = []
    for group in groups:
        group = [r for r in group if getattr(r, "train", True)]
        if config.failed_rollouts == "drop":
            group = [r for r in group if not r.result.failed]
        kept, filtered, overflowed, adv, cut = group_samples(group, config, teachers) if group else ([], 0, 0, [], 0)
        samples += kept
        filtered_seats += filtered
        overflowed_seats += overflowed
        overflowed_sequences += cut
        filtered_groups += not kept
        advantages += adv
    adv = np.abs(np.asarray(advantages or [0.0]))
    return samples, {
        "filtered/groups": filtered_groups,
        "filtered/seat_groups": filtered_seats,
        "filtered/overflowed_seat_groups": overflowed_seats,
        "filtered/overflowed_sequences": overflowed_sequences,
        "advantage/abs_mean": float(adv.mean()),
        "advantage/nonzero_fraction": float((adv >= ZERO).mean()),
    }


def seat_step_metrics(env: str, results: Sequence[RolloutResult], key_cap: MetricKeyCap) -> dict[str, float]:
    """``reward/<env>/<seat>/{mean,std}`` for envs with several seats, and every env metric's mean
    (``metrics/<env>/<name>``, seats pooled as vf-eval summarizes them, and ``metrics/<env>/<seat>/<name>`` where
    several play), at most ``key_cap.limit`` distinct names per env over the run (``metric_keys``; ``key_cap`` is the
    env runner's)."""
    out: dict[str, float] = {}
    done = [r for r in results if not r.failed]
    seats = {t.seat for r in done for t in r.traces}
    if len(seats) > 1:
        for seat in sorted(seats):
            rewards = np.array([t.reward for r in done for t in r.traces if t.seat == seat])
            out[f"reward/{env}/{seat}/mean"] = float(rewards.mean())
            out[f"reward/{env}/{seat}/std"] = float(rewards.std())
    # A failed rollout's metrics verifiers recorded count, as in vf-eval's summary; its traces never train.
    named = {f"metrics/{env}/{k}": v for k, v in summary_metrics(list(results)).items()}
    out.update(key_cap.apply(env, named))
    return out
