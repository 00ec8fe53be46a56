"""RL objectives. Each is a named class in ``LOSSES`` keyed by ``loss.type``; ``custom`` builds a user-supplied one
from ``loss.import_path``.

An objective maps one micro-batch to a per-token policy-gradient term; ``compute_loss`` adds the shared
options (KL penalty, entropy bonus) and normalizes (global token count or per sequence). Shapes are
``[rows, seq]`` (R, S); token ``t``'s log-prob was predicted from position ``t - 1``.

Notation: lp = trainer log-prob, lp_inf = inference log-prob, rho = lp - lp_inf, r = exp(rho), A = advantage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from prime_core.config import ConfigError
from prime_core.config.losses import (
    CISPOLossConfig,
    CustomLossConfig,
    DPPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    IPOLossConfig,
    LossConfig,
)
from torch import Tensor


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it (every tensor [R, S] on the training device)."""

    logprobs: Tensor
    """Trainer log-probs of each token (differentiable)."""
    inference_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    """bool: tokens trained on."""
    sample_ids: Tensor
    """Sample index per token (-1 on padding); a sample never spans micro-batches."""
    entropy: Tensor | None = None
    """Trainer entropy per position (differentiable when the entropy bonus is on)."""
    extra: dict[str, Tensor] = field(default_factory=dict)
    """The micro-batch file's further per-token arrays by name (``MicroBatch.extra``, filled by whoever packed it,
    e.g. from the orchestrator's ``Sample.extra``): a loss needing a new per-token input reads it here."""
    segments: tuple[Tensor, int] | None = None
    """(dense index of each loss token's sample [R, S], number of samples K), computed on the host by the trainer, for
    `segment_mean`; None: computed from ``sample_ids`` (which reads the device back: a sync on a GPU)."""


@dataclass
class PolicyTerm:
    """An objective's per-token policy-gradient loss and which tokens it dropped or clipped."""

    loss: Tensor
    """[R, S] per-token loss; zero off the loss mask, no policy gradient on dropped tokens (a regularizer may stay)."""
    masked: Tensor
    """bool [R, S]: loss tokens dropped (no policy gradient)."""
    clipped: Tensor
    """bool [R, S]: loss tokens whose ratio was clipped (no policy gradient from the clipped branch)."""


class Objective(Protocol):
    def __call__(self, b: LossInputs) -> PolicyTerm: ...


def _clamp(x: Tensor, low: float | None, high: float | None) -> Tensor:
    return x if low is None and high is None else x.clamp(min=low, max=high)


def _bounds(clip_low: float | None, clip_high: float | None) -> tuple[float | None, float | None]:
    return (None if clip_low is None else 1.0 - clip_low, None if clip_high is None else 1.0 + clip_high)


def _segments(sample_ids: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """Dense segment index (0..K-1) of every loss token's sample, and K. Non-loss tokens get index 0."""
    ids = torch.where(mask, sample_ids, sample_ids.new_full((), -1))
    uniq, inverse = torch.unique(ids, return_inverse=True)
    # uniq is sorted, so -1 (non-loss tokens), when present, is segment 0; drop it from the numbering.
    has_pad = bool((uniq < 0).any())
    inverse = (inverse - int(has_pad)).clamp(min=0)
    return inverse, uniq.numel() - int(has_pad)


def segment_mean(
    values: Tensor, sample_ids: Tensor, mask: Tensor, segments: tuple[Tensor, int] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample mean of ``values`` over loss tokens. Returns (mean per segment [K], count [K], token seg [R, S]).

    ``segments``: the dense index and count `_segments` would compute (`LossInputs.segments`); with them nothing is
    read back from the device, and tokens off the mask add zeros (the sums are the same)."""
    if segments is None:
        seg, k = _segments(sample_ids, mask)
        flat_seg, flat_mask = seg.reshape(-1), mask.reshape(-1)
        sums = values.new_zeros(k).index_add(0, flat_seg[flat_mask], values.reshape(-1)[flat_mask])
        counts = values.new_zeros(k).index_add(0, flat_seg[flat_mask], torch.ones_like(values.reshape(-1)[flat_mask]))
        return sums / counts.clamp(min=1), counts, seg
    seg, k = segments
    flat_seg, flat_mask = seg.reshape(-1), mask.reshape(-1)
    picked = torch.where(flat_mask, values.reshape(-1), values.new_zeros(()))
    # Tokens off the mask sit in segment 0, which exists even without a loss token (then dropped: K = 0).
    sums = values.new_zeros(max(k, 1)).index_add(0, flat_seg, picked)[:k]
    counts = values.new_zeros(max(k, 1)).index_add(0, flat_seg, flat_mask.to(values.dtype))[:k]
    return sums / counts.clamp(min=1), counts, seg


class GRPOLoss:
    """PPO-clip on the token ratio: max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), plus optional ratio masking."""

    def __init__(self, config: GRPOLossConfig):
        self.low, self.high = _bounds(config.clip_low, config.clip_high)
        self.mask_low, self.mask_high = config.mask_low, config.mask_high

    def __call__(self, b: LossInputs) -> PolicyTerm:
        ratio = torch.exp(b.logprobs - b.inference_logprobs)
        unclipped = -ratio * b.advantages
        clipped_branch = -_clamp(ratio, self.low, self.high) * b.advantages
        per_token = torch.maximum(unclipped, clipped_branch)
        clipped = b.loss_mask & (clipped_branch > unclipped)
        keep = b.loss_mask.clone()
        with torch.no_grad():
            if self.mask_low is not None:
                keep &= ratio >= self.mask_low
            if self.mask_high is not None:
                keep &= ratio <= self.mask_high
        return PolicyTerm(loss=per_token * keep, masked=b.loss_mask & ~keep, clipped=clipped & keep)


class GSPOLoss:
    """Sequence ratio s_i = exp(mean_t rho_t) over sample i's loss tokens: max(-s A, -clip(s) A) on every token of i."""

    def __init__(self, config: GSPOLossConfig):
        self.low, self.high = _bounds(config.clip_low, config.clip_high)

    def __call__(self, b: LossInputs) -> PolicyTerm:
        log_ratio = (b.logprobs - b.inference_logprobs) * b.loss_mask
        seq_log_ratio, _, seg = segment_mean(log_ratio, b.sample_ids, b.loss_mask, b.segments)
        # A micro-batch without loss tokens (a padding rank, a step whose groups were all filtered) has no segment,
        # yet every token's index is 0: one spare ratio keeps the gather in range; the mask zeroes its loss.
        seq_ratio = torch.cat([torch.exp(seq_log_ratio), seq_log_ratio.new_ones(1)])[seg]  # [R, S]
        unclipped = -seq_ratio * b.advantages
        clipped_branch = -_clamp(seq_ratio, self.low, self.high) * b.advantages
        per_token = torch.maximum(unclipped, clipped_branch) * b.loss_mask
        clipped = b.loss_mask & (clipped_branch > unclipped)
        return PolicyTerm(loss=per_token, masked=torch.zeros_like(b.loss_mask), clipped=clipped)


class CISPOLoss:
    """REINFORCE with a clipped, stop-gradient importance weight: -sg(clip(r)) A lp. Every token keeps a gradient."""

    def __init__(self, config: CISPOLossConfig):
        self.low, self.high = _bounds(config.clip_low, config.clip_high)

    def __call__(self, b: LossInputs) -> PolicyTerm:
        with torch.no_grad():
            ratio = torch.exp(b.logprobs - b.inference_logprobs)
            weight = _clamp(ratio, self.low, self.high)
            clipped = b.loss_mask & (weight != ratio)
        per_token = -weight * b.advantages * b.logprobs * b.loss_mask
        return PolicyTerm(loss=per_token, masked=torch.zeros_like(b.loss_mask), clipped=clipped)


def _trust_region_term(b: LossInputs, drop: Tensor, adv_tau: float, kl_tau: float) -> PolicyTerm:
    """-keep * adv_tau * A * r + kl_tau * (log r)^2: the dropped tokens lose the policy gradient, never the KL."""
    log_ratio = b.logprobs - b.inference_logprobs
    keep = b.loss_mask & ~drop
    per_token = -adv_tau * b.advantages * torch.exp(log_ratio) * keep + kl_tau * log_ratio**2 * b.loss_mask
    return PolicyTerm(loss=per_token, masked=b.loss_mask & drop, clipped=torch.zeros_like(b.loss_mask))


class DPPOLoss:
    """DPPO-Binary-TV mask on dp = p - p_inf by the sign of A (A > 0: drop dp > high; A <= 0: drop dp < -low), plus
    Kimi K2.5's squared log-ratio. prime-rl's default."""

    def __init__(self, config: DPPOLossConfig):
        self.config = config

    def __call__(self, b: LossInputs) -> PolicyTerm:
        c = self.config
        with torch.no_grad():
            dp = torch.exp(b.logprobs) - torch.exp(b.inference_logprobs)
            drop = torch.where(b.advantages > 0, dp > c.dppo_mask_high, dp < -c.dppo_mask_low)
        return _trust_region_term(b, drop, c.adv_tau, c.kl_tau)


class IPOLoss:
    """IPO (INTELLECT Policy Optimization): DPPO's objective with a symmetric mask |p - p_inf| > threshold."""

    def __init__(self, config: IPOLossConfig):
        self.config = config

    def __call__(self, b: LossInputs) -> PolicyTerm:
        with torch.no_grad():
            drop = (torch.exp(b.logprobs) - torch.exp(b.inference_logprobs)).abs() > self.config.ipo_threshold
        return _trust_region_term(b, drop, self.config.adv_tau, self.config.kl_tau)


def custom_objective(config: CustomLossConfig) -> Objective:
    """The objective ``loss.import_path`` names, built with ``loss.kwargs``."""
    module_name, _, attr = config.import_path.replace(":", ".").rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"loss.import_path={config.import_path!r} cannot be imported: {e}") from None
    try:
        objective = factory(**config.kwargs)
    except TypeError as e:
        raise ConfigError(f"loss.kwargs do not fit {config.import_path}: {e}") from None
    if not callable(objective):
        raise ConfigError(f"loss.import_path={config.import_path!r} must return a callable objective")
    return objective


LOSSES: dict[str, Callable[..., Objective]] = {
    "grpo": GRPOLoss,
    "gspo": GSPOLoss,
    "cispo": CISPOLoss,
    "dppo": DPPOLoss,
    "ipo": IPOLoss,
    "custom": custom_objective,
}


def build_objective(config: LossConfig) -> Objective:
    return LOSSES[config.type](config)


def kl_penalty(log_ratio: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(inference || trainer) from tokens sampled by inference; log_ratio = lp - lp_inf."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}")


# Sums each rank accumulates over its micro-batches; the trainer all-reduces them and divides by the token count.
STAT_KEYS = ("loss", "entropy", "mismatch_kl", "masked", "clipped", "kl")


def compute_loss(
    objective: Objective, config: LossConfig, b: LossInputs, *, num_tokens: int, num_samples: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's share of the step loss, and summed statistics.

    ``num_tokens`` / ``num_samples``: loss tokens / samples with a loss token in the whole step over all ranks,
    so that summing every micro-batch's loss over every rank gives the step objective.
    """
    mask = b.loss_mask
    term = objective(b)
    per_token = term.loss
    log_ratio = (b.logprobs - b.inference_logprobs) * mask
    kl = kl_penalty(log_ratio, config.kl_type) * mask
    if config.kl_coef:
        per_token = per_token + config.kl_coef * kl
    if config.entropy_coef:
        assert b.entropy is not None, "the entropy bonus needs the trainer entropy"
        per_token = per_token - config.entropy_coef * b.entropy * mask

    if config.normalization == "token":
        loss = per_token.sum() / max(num_tokens, 1)
    else:
        seq_mean, _, _ = segment_mean(per_token, b.sample_ids, mask, b.segments)
        loss = seq_mean.sum() / max(num_samples, 1)

    with torch.no_grad():
        stats = {
            "loss": loss.detach() * max(num_tokens, 1),  # re-divided by the token count after the all-reduce
            "entropy": (b.entropy * mask).sum() if b.entropy is not None else mask.new_zeros((), dtype=torch.float32),
            "mismatch_kl": kl_penalty(log_ratio.detach(), "k3").mul(mask).sum(),
            "masked": term.masked.sum().float(),
            "clipped": term.clipped.sum().float(),
            "kl": kl.detach().sum(),
        }
    return loss, stats
