"""The color-shapes README run on CPU: RL of the SFT'd tiny Qwen3-VL (examples/color_shapes/model) against images."""

from __future__ import annotations

import pytest

from tests.e2e.test_examples import readme_run


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(1800)
def test_color_shapes_readme_run_learns(tmp_path):
    """About a third of the SFT model's samples answer outside <answer></answer>; after 160 steps the held-out eval at
    temperature 1.0 gains at least 0.1 (measured: 0.23 -> 0.38 on 256 scenes), greedy decoding does
    not fall beyond noise (measured: 0.58 -> 0.64), and the training reward (10-step means) rises by at least 0.07
    (measured: 0.27 -> 0.36)."""
    t1, t0, rewards, trainer = readme_run(tmp_path, "color_shapes", "color-shapes")
    assert sorted(t1) == sorted(t0) == [0, 160], (t1, t0)
    assert t1[160] >= t1[0] + 0.1, t1
    assert t0[160] >= t0[0] - 0.03, t0
    assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.07, rewards
    assert max(v["mismatch_kl/mean"] for v in trainer.values()) < 1e-3
