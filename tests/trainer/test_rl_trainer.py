"""End-to-end RL trainer runs on CPU: FSDP over 2 processes equals 1 process; resume equals an uninterrupted run."""

import pytest
import torch
from prime_core.io import is_stable
from prime_core.run_dir import RunDir

from tests.trainer.trainer_utils import load_weights, read_trainer_metrics, run_cli, write_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess")]

COMMON = ["--seq-len", "32", "--optim.lr", "1e-3", "--seed", "3", "--async-level", "1", "--log.level", "warning"]


def trainer_args(model_dir, out, max_steps, *extra):
    return ["--model.name", str(model_dir), "--output-dir", str(out), "--max-steps", str(max_steps), *COMMON, *extra]


def test_two_process_fsdp_and_a_resumed_run_equal_one_uninterrupted_process(tiny_model_dir, tmp_path):
    """FSDP over 2 processes equals 1 process (steps 0-2, and the weights of step 3); a run stopped at step 5 and
    resumed from its step-3 checkpoint equals an uninterrupted one. One test: the 1-process side of the FSDP check is
    the first part of the resumed run (its step-3 weights are kept as its checkpoint's window), which spares a trainer
    start of its own."""
    straight, resumed, two = tmp_path / "straight", tmp_path / "resumed", tmp_path / "two"
    for out in (straight, resumed):
        write_rollouts(out, steps=6, num_ranks=1)
    write_rollouts(two, steps=3, num_ranks=2)  # the same global batches as the first 3 steps above
    run_cli(trainer_args(tiny_model_dir, straight, 6))
    # The first run saves step 3 in the background while it trains steps 3 and 4, then stops at 5.
    run_cli(trainer_args(tiny_model_dir, resumed, 5, "--ckpt.interval", "3", "--ckpt.save-async"))
    m1, w1 = read_trainer_metrics(resumed), load_weights(RunDir(resumed).weight_step(3))
    run_cli(trainer_args(tiny_model_dir, two, 3, "--ckpt.interval", "2", "--ckpt.save-async"), nproc=2)
    run_cli(trainer_args(tiny_model_dir, resumed, 6, "--ckpt.resume-step", "3"))

    m2 = read_trainer_metrics(two)
    assert sorted(m2) == [0, 1, 2]
    for step in m2:
        for key in ("loss/mean", "entropy/mean", "mismatch_kl/mean", "grad_norm"):
            assert m2[step][key] == pytest.approx(m1[step][key], abs=1e-6, rel=1e-6), (step, key)
        assert m1[step]["loss_tokens"] == m2[step]["loss_tokens"]
    w2 = load_weights(RunDir(two).weight_step(3))
    assert w1.keys() == w2.keys()
    max_diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert max_diff < 1e-6
    # The async checkpoint of step 2 and the final one of step 3 completed.
    assert is_stable(RunDir(two).trainer_checkpoint(2)) and is_stable(RunDir(two).checkpoint_step(3))

    a, b = read_trainer_metrics(straight), read_trainer_metrics(resumed)
    assert sorted(b) == list(range(6))
    assert [a[s]["loss/mean"] for s in range(6)] == [b[s]["loss/mean"] for s in range(6)]
    wa, wb = load_weights(RunDir(straight).weight_step(6)), load_weights(RunDir(resumed).weight_step(6))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Only the async window is kept (plus the checkpoint's window), and the final step always.
    assert RunDir(straight).stable_weight_steps() == [5, 6]
    assert RunDir(resumed).stable_weight_steps() == [2, 3, 4, 5, 6]  # windows of checkpoints 3 and 5
