"""RL objectives of the trainer (``trainer.loss``): a discriminated union on ``type``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from prime_core.config.base import BaseConfig
from prime_core.config.shared import MAX_COEF


class _LossOptions(BaseConfig):
    """Options shared by every RL objective."""

    kl_coef: float = Field(default=0.0, ge=0, le=MAX_COEF)
    """Weight of the KL penalty between the trainer policy and the inference (sampling) policy."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of KL(inference || trainer) on sampled tokens: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    entropy_coef: float = Field(default=0.0, ge=0, le=MAX_COEF)
    """Entropy bonus: subtract this times the token entropy of the trainer policy from the loss."""
    normalization: Literal["token", "sequence"] = "token"
    """token: sum over every loss token of the step divided by the global token count; sequence: mean over each
    sample's tokens, then mean over the step's samples."""


class GRPOLossConfig(_LossOptions):
    """Token-level importance ratio r = pi_theta / pi_inference with PPO-style asymmetric clipping and/or masking."""

    type: Literal["grpo"] = "grpo"
    """Objective type."""
    clip_low: float | None = Field(default=0.2, ge=0, le=1)
    """Clip r below at 1 - clip_low (PPO epsilon); unset disables clipping from below."""
    clip_high: float | None = Field(default=0.28, ge=0, le=MAX_COEF)
    """Clip r above at 1 + clip_high (DAPO's clip-higher); unset disables clipping from above."""
    mask_low: float | None = Field(default=None, ge=0, lt=1)
    """Drop (zero loss and gradient) tokens whose ratio is below this value, e.g. 0.125, below 1 (else on-policy
    tokens, ratio 1, would be dropped); unset keeps them."""
    mask_high: float | None = Field(default=None, gt=1)
    """Drop tokens whose ratio is above this value, e.g. 8, above 1 (else on-policy tokens would be dropped);
    unset keeps them."""


class GSPOLossConfig(_LossOptions):
    """Sequence-level ratio s = geometric mean of the token ratios of a sample, clipped PPO-style."""

    type: Literal["gspo"] = "gspo"
    """Objective type."""
    clip_low: float = Field(default=3e-4, ge=0, le=1)
    """Clip s below at 1 - clip_low (GSPO uses much smaller ranges than token-level PPO)."""
    clip_high: float = Field(default=4e-4, ge=0, le=MAX_COEF)
    """Clip s above at 1 + clip_high."""
    normalization: Literal["token", "sequence"] = "sequence"
    """Normalization; GSPO defines its objective per sequence."""


class CISPOLossConfig(_LossOptions):
    """Clipped stop-gradient importance weight times the log-prob: -sg(clip(r)) * A * log pi_theta."""

    type: Literal["cispo"] = "cispo"
    """Objective type."""
    clip_low: float | None = Field(default=None, ge=0, le=1)
    """Clip the weight below at 1 - clip_low; unset leaves it unbounded below (as in MiniMax-M1)."""
    clip_high: float | None = Field(default=0.28, ge=0, le=MAX_COEF)
    """Clip the weight above at 1 + clip_high."""


class DPPOLossConfig(_LossOptions):
    """DPPO-Binary-TV trust-region mask on the probability difference (conditioned on the advantage's sign) with a
    squared-log-ratio KL regularizer (Kimi K2.5): prime-rl's default RL loss. No ratio clipping: the mask replaces
    it."""

    type: Literal["dppo"] = "dppo"
    """Objective type."""
    dppo_mask_low: float = Field(default=0.2, ge=0, le=1)
    """Drop a token with A <= 0 whose probability fell by more than this: p_theta - p_inference < -dppo_mask_low."""
    dppo_mask_high: float = Field(default=0.2, ge=0, le=1)
    """Drop a token with A > 0 whose probability rose by more than this: p_theta - p_inference > dppo_mask_high."""
    adv_tau: float = Field(default=1.0, ge=0, le=MAX_COEF)
    """Scale of the advantage (policy-gradient) term; 0 leaves only the KL regularizer."""
    kl_tau: float = Field(default=1e-3, ge=0, le=MAX_COEF)
    """Weight of the squared log-ratio (log r)^2 on every loss token, dropped or not; 0 disables it."""


class IPOLossConfig(_LossOptions):
    """IPO (INTELLECT Policy Optimization): as ``dppo`` but the trust region is symmetric and ignores the sign of A."""

    type: Literal["ipo"] = "ipo"
    """Objective type."""
    ipo_threshold: float = Field(default=0.1, ge=0, le=1)
    """Drop a token whose probability moved by more than this either way: |p_theta - p_inference| > ipo_threshold."""
    adv_tau: float = Field(default=1.0, ge=0, le=MAX_COEF)
    """Scale of the advantage (policy-gradient) term; 0 leaves only the KL regularizer."""
    kl_tau: float = Field(default=1e-3, ge=0, le=MAX_COEF)
    """Weight of the squared log-ratio (log r)^2 on every loss token, dropped or not; 0 disables it."""


class CustomLossConfig(_LossOptions):
    """A user-supplied objective, found by import path; the shared options (KL, entropy, normalization) apply to it."""

    type: Literal["custom"] = "custom"
    """Objective type."""
    import_path: str = Field(pattern=r"^[A-Za-z_][\w.]*[.:][A-Za-z_]\w*$")
    """``package.module:Name`` (or ``package.module.Name``) of a callable that, called with ``kwargs``, returns the
    objective: a callable from ``prime_trainer.rl.loss.LossInputs`` to ``PolicyTerm`` (a class with ``__call__``
    fits). It is imported when the trainer starts, in every rank."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of that callable."""


LossConfig = Annotated[
    GRPOLossConfig | GSPOLossConfig | CISPOLossConfig | DPPOLossConfig | IPOLossConfig | CustomLossConfig,
    Field(discriminator="type"),
]
