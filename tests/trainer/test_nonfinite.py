"""A step whose gradients are not finite must not reach the weights: one NaN would otherwise be written into every
weight, published to inference and checkpointed, and the run would go on training garbage unattended."""

import numpy as np
import pytest
import torch
from prime_core.run_dir import RunDir

from tests.trainer.test_rl_trainer import trainer_args
from tests.trainer.trainer_utils import load_weights, make_step_batches, read_trainer_metrics, run_cli, write_rollouts

pytestmark = [pytest.mark.integration]


def batches(step: int, poisoned: bool = False):
    out = make_step_batches(step, 4, 2, 32, 96)
    if poisoned:  # one completion token's inference log-prob (an engine's NaN): its importance ratio is NaN
        mb = out[2]
        r, t = np.argwhere(mb.loss_mask)[0]
        mb.inference_logprobs[r, t] = np.nan
    return out


@pytest.mark.parametrize(
    "ranks", [1, pytest.param(2, marks=pytest.mark.xdist_group("multiprocess"))], ids=["one_rank", "fsdp_two_ranks"]
)
def test_a_step_with_nan_gradients_is_skipped_as_if_its_batch_never_came(tiny_model_dir, tmp_path, ranks):
    """With two ranks only one rank's micro-batch holds the NaN: the norm is global, so both skip (or one would step
    and the ranks' shards would part ways)."""
    poisoned, without = tmp_path / "poisoned", tmp_path / "without"
    write_rollouts(poisoned, steps=4, num_ranks=ranks, batches_of=lambda s: batches(s, poisoned=s == 1))
    order = [0, 2, 3]  # the same run with step 1's batch left out
    write_rollouts(without, steps=3, num_ranks=1, batches_of=lambda s: batches(order[s]))
    proc = run_cli(trainer_args(tiny_model_dir, poisoned, 4), nproc=ranks)
    run_cli(trainer_args(tiny_model_dir, without, 3))

    m = read_trainer_metrics(poisoned)
    assert m[1]["grad_norm"] is None and m[1]["optim/skipped"] == 1  # metrics.jsonl holds NaN as null
    assert [m[s]["optim/skipped"] for s in (0, 2, 3)] == [0, 0, 0]
    assert "step 1: gradient norm is nan: optimizer step skipped, weights unchanged (1 in a row)" in proc.stdout
    # Weights and AdamW's moments and step count were left as they were: the rest of the run is the run without it.
    a, b = load_weights(RunDir(poisoned).weight_step(4)), load_weights(RunDir(without).weight_step(3))
    assert all(torch.isfinite(a[k]).all() for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= (0 if ranks == 1 else 1e-6)


def test_non_finite_gradients_every_step_stop_the_trainer_in_one_line(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    write_rollouts(out, steps=4, num_ranks=1, batches_of=lambda s: batches(s, poisoned=True))
    with pytest.raises(AssertionError) as failed:
        run_cli(trainer_args(tiny_model_dir, out, 4, "--optim.max-skipped-steps", "1"))
    message = str(failed.value)
    assert (
        "error: step 1: gradient norm is nan, 2 steps in a row (optim.max_skipped_steps = 1): the loss or the data is "
        "not finite every step, or the weights already are" in message
    )
    assert "Traceback" not in message
    # What was published (the skipped step 0's weights, step 1) is the initial model, finite.
    run = RunDir(out)
    first, after = load_weights(run.weight_step(0)), load_weights(run.weight_step(1))
    assert all(torch.isfinite(after[k]).all() and torch.equal(after[k], first[k]) for k in after)
