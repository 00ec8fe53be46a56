"""RL objectives against hand-computed values on tiny batches."""

import math
import re

import pytest
import torch
from prime_core.config import ConfigError
from prime_core.config.losses import (
    CISPOLossConfig,
    CustomLossConfig,
    DPPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    IPOLossConfig,
)
from prime_trainer.rl.loss import LOSSES, LossInputs, PolicyTerm, build_objective, compute_loss, kl_penalty


def batch(lp, lp_inf, adv, mask, sample_ids, entropy=None):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    logprobs = t(lp).requires_grad_(True)
    return LossInputs(
        logprobs=logprobs,
        inference_logprobs=t(lp_inf),
        advantages=t(adv),
        loss_mask=torch.tensor([mask], dtype=torch.bool),
        sample_ids=torch.tensor([sample_ids]),
        entropy=None if entropy is None else t(entropy).requires_grad_(True),
    )


def run(config, b, num_tokens, num_samples=1):
    loss, stats = compute_loss(build_objective(config), config, b, num_tokens=num_tokens, num_samples=num_samples)
    loss.backward()
    return loss.item(), b.logprobs.grad[0].tolist(), stats


L = math.log


def test_registry_has_every_type():
    assert set(LOSSES) == {"grpo", "gspo", "cispo", "dppo", "ipo", "custom"}


class Reinforce:
    """A user-supplied objective for the ``custom`` loss: -scale * A * lp on loss tokens."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, b: LossInputs) -> PolicyTerm:
        none = torch.zeros_like(b.loss_mask)
        return PolicyTerm(loss=-self.scale * b.advantages * b.logprobs * b.loss_mask, masked=none, clipped=none)


def test_custom_loss_by_import_path():
    config = CustomLossConfig(import_path="tests.trainer.test_loss:Reinforce", kwargs={"scale": 2.0}, kl_coef=0.1)
    b = batch([0.0, L(0.5), L(0.6)], [0.0, L(0.5), L(0.5)], [0, 1.0, 1.0], [0, 1, 1], [0, 0, 0])
    loss, grad, stats = run(config, b, num_tokens=2)
    kl = 1.2 - 1 - L(1.2)  # k3 of token 2; token 1 has ratio 1
    assert loss == pytest.approx((-2.0 * (L(0.5) + L(0.6)) + 0.1 * kl) / 2)
    assert grad == pytest.approx([0.0, -1.0, -1.0 + 0.1 * (1.2 - 1) / 2])
    assert stats["clipped"].item() == 0


@pytest.mark.parametrize(
    "path,kwargs,message",
    [
        ("tests.trainer.no_such_module:Reinforce", {}, "loss.import_path='tests.trainer.no_such_module:Reinforce'"),
        ("tests.trainer.test_loss.NoSuchLoss", {}, "cannot be imported"),
        ("tests.trainer.test_loss:Reinforce", {"bad": 1}, "loss.kwargs do not fit"),
    ],
)
def test_custom_loss_errors_name_the_field(path, kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_objective(CustomLossConfig(import_path=path, kwargs=kwargs))
    with pytest.raises(ValueError, match="import_path"):
        CustomLossConfig(import_path="not a path")


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_grpo_asymmetric_clip(adv):
    # Position 0 is a prompt token. Ratios: token 1 r = 1, token 2 r = 0.6 / 0.4 = 1.5 (above 1 + 0.28).
    b = batch([0.0, L(0.5), L(0.6)], [0.0, L(0.5), L(0.4)], [0, adv, adv], [0, 1, 1], [0, 0, 0])
    loss, grad, stats = run(GRPOLossConfig(), b, num_tokens=2)
    if adv > 0:
        # max(-1.5, -1.28) = -1.28: the clipped branch is active, token 2 gets no gradient.
        assert loss == pytest.approx((-1.0 - 1.28) / 2)
        assert grad == pytest.approx([0.0, -0.5, 0.0])
        assert stats["clipped"].item() == 1
    else:
        # max(1.5, 1.28) = 1.5: unclipped, gradient r * |A| / N.
        assert loss == pytest.approx((1.0 + 1.5) / 2)
        assert grad == pytest.approx([0.0, 0.5, 0.75])
        assert stats["clipped"].item() == 0


def test_grpo_lower_clip_and_no_clip():
    # r = 0.5 < 1 - 0.2 with A < 0: max(0.5, 0.8) = 0.8 -> clipped, no gradient.
    b = batch([0.0, L(0.25)], [0.0, L(0.5)], [0, -1.0], [0, 1], [0, 0])
    loss, grad, _ = run(GRPOLossConfig(), b, num_tokens=1)
    assert loss == pytest.approx(0.8) and grad == pytest.approx([0.0, 0.0])
    b = batch([0.0, L(0.25)], [0.0, L(0.5)], [0, -1.0], [0, 1], [0, 0])
    loss, grad, _ = run(GRPOLossConfig(clip_low=None, clip_high=None), b, num_tokens=1)
    assert loss == pytest.approx(0.5) and grad == pytest.approx([0.0, 0.5])


def test_grpo_ratio_masking():
    b = batch([0.0, L(0.5), L(0.6)], [0.0, L(0.5), L(0.4)], [0, 1.0, 1.0], [0, 1, 1], [0, 0, 0])
    loss, grad, stats = run(GRPOLossConfig(clip_low=None, clip_high=None, mask_high=1.2), b, num_tokens=2)
    # Token 2 (r = 1.5) is dropped but still counts in the token normalization.
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx([0.0, -0.5, 0.0])
    assert stats["masked"].item() == 1


def test_gspo_sequence_ratio():
    # Sample 0: s = sqrt(1.1 * 0.9) < 1 - 3e-4 with A > 0 -> unclipped; sample 1: s = 1.2 > 1 + 4e-4 -> clipped.
    lp = [0.0, L(0.55), L(0.45), 0.0, L(0.6)]
    lp_inf = [0.0, L(0.5), L(0.5), 0.0, L(0.5)]
    b = batch(lp, lp_inf, [0, 1.0, 1.0, 0, 1.0], [0, 1, 1, 0, 1], [0, 0, 0, 1, 1])
    loss, grad, stats = run(GSPOLossConfig(), b, num_tokens=3, num_samples=2)
    s0 = math.sqrt(1.1 * 0.9)
    assert loss == pytest.approx((-s0 - (1 + 4e-4)) / 2)
    # d(-s0)/d lp_t = -s0 / 2 (mean over 2 tokens), then / 2 samples.
    assert grad == pytest.approx([0.0, -s0 / 4, -s0 / 4, 0.0, 0.0])
    assert stats["clipped"].item() == 1  # the one token of sample 1


def test_cispo_weight_is_clipped_and_stopped():
    b = batch([0.0, L(0.5), L(0.6)], [0.0, L(0.5), L(0.4)], [0, 1.0, 1.0], [0, 1, 1], [0, 0, 0])
    loss, grad, stats = run(CISPOLossConfig(), b, num_tokens=2)
    assert loss == pytest.approx((-L(0.5) - 1.28 * L(0.6)) / 2)
    assert grad == pytest.approx([0.0, -0.5, -0.64])  # -sg(w) * A / N: the clipped token keeps a gradient
    assert stats["clipped"].item() == 1


@pytest.mark.parametrize(
    "kind,value,dvalue",
    [
        ("k1", lambda rho: -rho, lambda rho: -1.0),
        ("k2", lambda rho: 0.5 * rho**2, lambda rho: rho),
        ("k3", lambda rho: math.exp(rho) - 1 - rho, lambda rho: math.exp(rho) - 1),
    ],
)
def test_kl_penalty(kind, value, dvalue):
    rho = L(1.5)
    b = batch([0.0, L(0.6)], [0.0, L(0.4)], [0, 0.0], [0, 1], [0, 0])
    loss, grad, stats = run(GRPOLossConfig(kl_coef=0.1, kl_type=kind), b, num_tokens=1)
    assert loss == pytest.approx(0.1 * value(rho))
    assert grad == pytest.approx([0.0, 0.1 * dvalue(rho)])
    assert stats["mismatch_kl"].item() == pytest.approx(1.5 - 1 - rho)
    assert kl_penalty(torch.tensor(0.0), kind).item() == 0.0


def test_entropy_bonus():
    b = batch([0.0, L(0.5)], [0.0, L(0.5)], [0, 0.0], [0, 1], [0, 0], entropy=[9.0, 2.0])
    loss, _, stats = run(GRPOLossConfig(entropy_coef=0.01), b, num_tokens=1)
    assert loss == pytest.approx(-0.02)
    assert b.entropy.grad[0].tolist() == pytest.approx([0.0, -0.01])
    assert stats["entropy"].item() == pytest.approx(2.0)


def test_sequence_normalization():
    # Two samples of 1 and 3 loss tokens, ratio 1, A = 1: per-token loss -1, each sample's mean is -1.
    lp = [0.0, L(0.5), 0.0, L(0.5), L(0.5), L(0.5)]
    b = batch(lp, lp, [0, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1])
    loss, grad, _ = run(GRPOLossConfig(normalization="sequence"), b, num_tokens=4, num_samples=2)
    assert loss == pytest.approx(-1.0)
    assert grad == pytest.approx([0.0, -0.5, 0.0, -1 / 6, -1 / 6, -1 / 6])
    b = batch(lp, lp, [0, 1, 0, 1, 1, 1], [0, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1])
    loss, grad, _ = run(GRPOLossConfig(normalization="token"), b, num_tokens=4)
    assert grad == pytest.approx([0.0, -0.25, 0.0, -0.25, -0.25, -0.25])


# Four loss tokens after a prompt token: (p_inference, p_theta, A). Probability differences 0, +0.3, -0.15, -0.3.
TRUST_REGION_TOKENS = [(0.5, 0.5, 1.0), (0.3, 0.6, 1.0), (0.5, 0.35, -1.0), (0.6, 0.3, -0.5)]


def trust_region_by_hand(in_region, adv_tau, kl_tau):
    """The DPPO (arXiv 2602.04879) binary-TV objective with Kimi K2.5's KL, token by token: a token in the trust
    region contributes -adv_tau * A * pi/mu, every token kl_tau * log(pi/mu)^2; d/d log pi is -adv_tau * A * pi/mu
    (in region) + 2 * kl_tau * log(pi/mu). Returns (mean loss, gradient per position incl. the prompt)."""
    losses, grads = [], [0.0]
    for mu, pi, adv in TRUST_REGION_TOKENS:
        rho, keep = math.log(pi / mu), in_region(pi - mu, adv)
        losses.append(-keep * adv_tau * adv * pi / mu + kl_tau * rho**2)
        grads.append((-keep * adv_tau * adv * pi / mu + 2 * kl_tau * rho) / len(TRUST_REGION_TOKENS))
    return sum(losses) / len(losses), grads


def trust_region_batch():
    mu, pi, adv = zip(*TRUST_REGION_TOKENS, strict=True)
    return batch([0.0, *map(L, pi)], [0.0, *map(L, mu)], [0, *adv], [0, 1, 1, 1, 1], [0] * 5)


def test_dppo_masks_by_the_sign_of_the_advantage():
    # Binary TV trust region: A > 0 may not raise p by more than 0.2, A <= 0 may not lower it by more than 0.2.
    config = DPPOLossConfig(adv_tau=0.5, kl_tau=0.1)
    loss, grad, stats = run(config, trust_region_batch(), num_tokens=4)
    want_loss, want_grad = trust_region_by_hand(lambda dp, a: (dp <= 0.2) if a > 0 else (dp >= -0.2), 0.5, 0.1)
    assert loss == pytest.approx(want_loss)
    assert grad == pytest.approx(want_grad)
    assert stats["masked"].item() == 2  # tokens 2 (+0.3, A > 0) and 4 (-0.3, A < 0)
    assert stats["clipped"].item() == 0


def test_ipo_masks_both_directions():
    config = IPOLossConfig(adv_tau=0.5, kl_tau=0.1)
    loss, grad, stats = run(config, trust_region_batch(), num_tokens=4)
    want_loss, want_grad = trust_region_by_hand(lambda dp, a: abs(dp) <= 0.1, 0.5, 0.1)
    assert loss == pytest.approx(want_loss)
    assert grad == pytest.approx(want_grad)
    assert stats["masked"].item() == 3


def test_dppo_and_ipo_defaults():
    # prime-rl's checks: ratio 1, A = 1, one token -> loss -1, gradient -1; dp = +0.3 with A > 0 is dropped and keeps
    # only the KL gradient 2 * kl_tau * rho; dp = -0.15 with A > 0 is dropped by IPO (0.1) but not by DPPO (0.2).
    for config in (DPPOLossConfig(), IPOLossConfig()):
        loss, grad, _ = run(config, batch([0.0, L(0.5)], [0.0, L(0.5)], [0, 1.0], [0, 1], [0, 0]), num_tokens=1)
        assert (loss, grad) == (pytest.approx(-1.0), pytest.approx([0.0, -1.0]))
    _, grad, _ = run(DPPOLossConfig(), batch([0.0, L(0.6)], [0.0, L(0.3)], [0, 1.0], [0, 1], [0, 0]), num_tokens=1)
    assert grad == pytest.approx([0.0, 2e-3 * L(2.0)])
    lower = batch([0.0, L(0.35)], [0.0, L(0.5)], [0, 1.0], [0, 1], [0, 0])
    assert run(DPPOLossConfig(), lower, num_tokens=1)[2]["masked"].item() == 0
    lower = batch([0.0, L(0.35)], [0.0, L(0.5)], [0, 1.0], [0, 1], [0, 0])
    assert run(IPOLossConfig(), lower, num_tokens=1)[2]["masked"].item() == 1
