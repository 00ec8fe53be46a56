import numpy as np
import pytest
from prime_core.config.orchestrator import AdvantageConfig, LengthPenaltyConfig
from prime_orchestrator.advantages import ADVANTAGES, compute_advantages


def adv(rewards, lengths=None, **kw):
    return compute_advantages(rewards, lengths or [1] * len(rewards), AdvantageConfig(**kw))


def test_grpo_mean_baseline():
    np.testing.assert_allclose(adv([0, 0, 1, 1]), [-0.5, -0.5, 0.5, 0.5])
    np.testing.assert_allclose(adv([1, 1, 1, 1]), [0, 0, 0, 0])
    np.testing.assert_allclose(adv([0.7]), [0.0])  # a singleton group has no baseline


def test_grpo_std_norm():
    # r = [0, 1]: mean 0.5, std 0.5 -> [-1, 1]
    np.testing.assert_allclose(adv([0, 1], std_norm=True), [-1, 1], atol=1e-5)


def test_rloo_leave_one_out():
    np.testing.assert_allclose(adv([0, 1], type="rloo"), [-1, 1])
    # r = [1, 2, 6]: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    np.testing.assert_allclose(adv([1, 2, 6], type="rloo"), [-3, -1.5, 4.5])


def test_opo_length_weighted_baseline():
    # baseline = (1*1 + 0*3) / 4 = 0.25
    np.testing.assert_allclose(adv([1, 0], [1, 3], type="opo"), [0.75, -0.25])


def test_length_penalty():
    # r=[1,1], len=[2,4]: r' = 1 - 1*0.5*[0.5, 1] = [0.75, 0.5]; centered -> [0.125, -0.125]
    cfg = {"length_penalty": LengthPenaltyConfig(enabled=True, weight=0.5)}
    np.testing.assert_allclose(adv([1, 1], [2, 4], **cfg), [0.125, -0.125])
    np.testing.assert_allclose(adv([0, 0], [2, 4], **cfg), [0, 0])  # all-zero groups stay zero


def test_registry_names():
    assert set(ADVANTAGES) == {"grpo", "rloo", "opo"}
    with pytest.raises(ValueError):
        AdvantageConfig(type="nope")
