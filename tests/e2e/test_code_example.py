"""The code example's README run learns: RL from the shipped SFT model (examples/code/model) moves it from hard-coding
the prompt's example calls to writing the function, scored by hidden unit tests in the sandbox pool."""

from __future__ import annotations

import pytest

from tests.e2e.test_examples import readme_run

MAX_STEPS = 40


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(1800)
def test_code_readme_run_learns(tmp_path):
    """The held-out eval at temperature 1.0 gains at least 0.1 (measured: 0.35 -> 0.54 over 64 tasks x 4 samples),
    greedy decoding loses at most 0.06 (measured: 0.70 -> 0.68 over 64 tasks; one standard error is about 0.05), and
    the trainer and inference agree on the sampled tokens. The training reward is left out: 4 tasks a step make it
    vary more between steps than RL moves it."""
    t1, t0, _, trainer = readme_run(tmp_path, "code", "code-tasks")
    assert sorted(t1) == sorted(t0) == [0, MAX_STEPS], (t1, t0)
    assert t1[MAX_STEPS] >= t1[0] + 0.1, t1
    assert t0[MAX_STEPS] >= t0[0] - 0.06, t0
    assert max(v["mismatch_kl/mean"] for v in trainer.values()) < 1e-3
