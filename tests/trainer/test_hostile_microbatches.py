"""Micro-batches a buggy or hostile orchestrator could hand the trainer, read where the batch comes in
(`RolloutSource.get`, both transports): each is refused in one line naming the step, file, micro-batch, field and
position, before anything trains on it. Before, positions, masks and log-probs that no packer writes trained silently
(the loss changed, the weights moved), a FIFO at the path hung the trainer for good, and a step without a loss token
still moved every weight through AdamW's moments."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from prime_core.config import load_config
from prime_core.config.trainer import TrainerConfig
from prime_core.io import UnreadableFile
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import RolloutBatchMeta, microbatch_tensors, write_microbatches
from prime_trainer.rl.data import RolloutSource
from prime_trainer.world import World
from safetensors.numpy import save_file

from tests.trainer.trainer_utils import load_weights, make_step_batches, read_trainer_metrics, run_cli, write_rollouts

WHERE = "step 0: rollouts for rank 0 (rollouts/step_0/rank_0): "


def source(out) -> RolloutSource:
    config = load_config(TrainerConfig, ["--output-dir", str(out), "--data.wait-timeout-s", "5"])
    return RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def first_loss_token(mb) -> tuple[int, int]:
    r, t = np.argwhere(mb.loss_mask)[0]
    return int(r), int(t)


def negative_position(b):
    b[1].position_ids[0, 3] = -7


def huge_position(b):
    b[1].position_ids[0, 5] = 10**9


def shuffled_positions(b):
    b[1].position_ids[:] = np.random.default_rng(0).integers(0, 32, b[1].position_ids.shape)


def loss_on_first_token(b):
    b[1].loss_mask[0, 0] = True


def loss_on_padding(b):
    b[1].sample_ids[0, :] = -1


def positive_logprob(b):
    b[1].inference_logprobs[first_loss_token(b[1])] = 50.0


def negative_image_grid(b):
    """(1, -2, -2) multiplies to the 4 patches there are: the shape check alone let it through to the vision tower."""
    b[1].pixel_values, b[1].image_grid_thw = np.zeros((4, 8), np.float32), np.array([[1, -2, -2]])


def no_rows(b):
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "sample_ids"):
        setattr(b[1], name, getattr(b[1], name)[:0])


CASES = {
    negative_position: r"micro-batch 1 position_ids\[0, 3\] is -7 \(a position is >= 0\)",
    huge_position: r"micro-batch 1 position_ids\[0, 5\] is 1000000000, expected \d+ \(sample \d+: positions count 0, "
    r"1, \.\.\. from the sample's first token\)",
    shuffled_positions: r"micro-batch 1 position_ids\[0, 0\] is \d+, expected 0 \(sample \d+: positions count 0, 1, "
    r"\.\.\. from the sample's first token\)",
    loss_on_first_token: r"micro-batch 1 loss_mask\[0, 0\] is set on a sample's first token, which no earlier token "
    r"predicts",
    loss_on_padding: r"micro-batch 1 sample_ids\[0, \d+\] is -1 \(padding\) on a loss token",
    positive_logprob: r"micro-batch 1 inference_logprobs\[\d+, \d+\] is above 0 \(a log-prob\): 50\.0",
    no_rows: r"micro-batch 1 holds no rows",
    negative_image_grid: r"micro-batch 1 image_grid_thw\[0\] is \[1, -2, -2\] \(an image's t, h, w patch counts are "
    r">= 1\)",
}


@pytest.mark.parametrize("mutate", list(CASES), ids=lambda f: f.__name__)
def test_a_micro_batch_no_packer_writes_is_one_line_naming_field_and_position(tmp_path, mutate):
    def batches_of(step):
        out = make_step_batches(step, 2, 2, 32, 96)
        mutate(out)
        return out

    write_rollouts(tmp_path, steps=1, num_ranks=1, batches_of=batches_of)
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(WHERE)}{CASES[mutate]}$"):
        source(tmp_path).get(0, vocab_size=96)


def test_the_packers_micro_batches_pass(tmp_path):
    """Tail padding that counts on from the row's start (not from 0) is not a sample's: its positions are free."""
    write_rollouts(tmp_path, steps=1, num_ranks=1, micro_batches_per_step=3)
    meta, batches = source(tmp_path).get(0, vocab_size=96)
    assert meta.step == 0 and len(batches) == 3


def write_meta(out, mbs, **meta):
    path = RunDir(out).rollout_file(0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {"schema_version": 1, "step": 0, "rank": 0, "num_micro_batches": len(mbs), "seq_len": 32, **meta}
    tensors = {k: v for i, mb in enumerate(mbs) for k, v in microbatch_tensors(i, mb).items()}
    save_file(tensors, str(path), metadata={"prime": json.dumps(fields)})
    return path


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"temperature": 0.0}, "meta field 'temperature' is 0.0: Input should be greater than 0"),
        ({"temperature": -1.0}, "meta field 'temperature' is -1.0: Input should be greater than 0"),
        ({"temperature": float("nan")}, "meta field 'temperature' is nan: Input should be a finite number"),
        ({"num_micro_batches": -1}, "meta field 'num_micro_batches' is -1: Input should be greater than or equal to 0"),
    ],
)
def test_a_header_no_orchestrator_writes_is_one_line_naming_the_field(tmp_path, meta, why):
    """Temperature divides the logits: 0 made them infinite (every step skipped as NaN, naming no cause), a negative
    one trained toward the tokens the policy least prefers, without an error."""
    path = write_meta(tmp_path, make_step_batches(0, 1, 2, 32, 96), **meta)
    line = f"step 0: rollouts for rank 0: {path}: {why}"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        source(tmp_path).get(0, vocab_size=96)


def test_rows_of_another_length_than_the_header_says_are_refused(tmp_path):
    write_meta(tmp_path, make_step_batches(0, 1, 2, 32, 96), seq_len=16)
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(WHERE)}micro-batch 0 rows are 32 tokens long, the file's "):
        source(tmp_path).get(0, vocab_size=96)


def test_rows_longer_than_the_trainers_seq_len_are_refused(tmp_path):
    """The trainer plans its memory (and splits rows over context-parallel ranks) for its own seq_len."""
    write_rollouts(tmp_path, steps=1, num_ranks=1, seq_len=64)
    config = load_config(TrainerConfig, ["--output-dir", str(tmp_path), "--seq-len", "32"])
    rollouts = RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    line = f"{WHERE}rows of 64 tokens, longer than this trainer's seq_len of 32 (the orchestrator's seq_len must not "
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}"):
        rollouts.get(0, vocab_size=96)


def test_rows_context_parallelism_cannot_split_are_refused(tmp_path):
    write_rollouts(tmp_path, steps=1, num_ranks=1, seq_len=30)
    config = load_config(TrainerConfig, ["--output-dir", str(tmp_path), "--seq-len", "32", "--model.cp", "2"])
    rollouts = RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    line = f"{WHERE}rows of 30 tokens do not split into 2 * model.cp = 4 equal chunks (context parallelism)"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        rollouts.get(0, vocab_size=96)


def test_tensors_past_the_header_count_are_refused_not_dropped(tmp_path):
    """The header said one micro-batch, the file held two: the second's rows were dropped without a word."""
    path = write_meta(tmp_path, make_step_batches(0, 2, 2, 32, 96), num_micro_batches=1)
    line = (
        f"step 0: rollouts for rank 0: {path}: unreadable micro-batch file (ValueError: tensor '1.advantages' is not a "
        "field of micro-batches 0..0 (meta num_micro_batches = 1))"
    )
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        source(tmp_path).get(0, vocab_size=96)


def test_a_file_of_another_rank_is_refused(tmp_path):
    """Rank 1's file at rank 0's path: rank 0 trained rank 1's samples, which rank 1 trained too (counted twice)."""
    write_rollouts(tmp_path, steps=1, num_ranks=2)
    run = RunDir(tmp_path)
    run.rollout_file(0, 1).replace(run.rollout_file(0, 0))
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(WHERE)}the file is of rank 1$"):
        source(tmp_path).get(0, vocab_size=96)


def test_non_finite_advantages_are_named_by_field(tmp_path, caplog):
    """They reach the loss (the step's optimizer step is then skipped, tests/trainer/test_nonfinite.py); the warning
    names where they came from, which the skip's line cannot."""

    def batches_of(step):
        out = make_step_batches(step, 2, 2, 32, 96)
        out[1].advantages[first_loss_token(out[1])] = np.inf
        return out

    write_rollouts(tmp_path, steps=1, num_ranks=1, batches_of=batches_of)
    source(tmp_path).get(0, vocab_size=96)
    assert f"{WHERE}micro-batch 1: advantages holds 1 non-finite value(s) on loss tokens" in caplog.text


READ_FIFO = """
import torch
from prime_core.config import load_config
from prime_core.config.trainer import TrainerConfig
from prime_trainer.rl.data import RolloutSource
from prime_trainer.world import World
config = load_config(TrainerConfig, ["--output-dir", {out!r}, "--data.wait-timeout-s", "5"])
source = RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
try:
    source.get(0, vocab_size=96)
except Exception as e:
    print(type(e).__name__, e)
"""


@pytest.mark.parametrize("kind", ["fifo", "link_to_device"])
def test_a_fifo_or_device_at_the_rollout_path_is_one_line_not_a_hang(tmp_path, kind):
    """Before, ``open`` of a FIFO blocked for good while holding the GIL: no thread of the trainer ran again."""
    path = RunDir(tmp_path).rollout_file(0, 0)
    path.parent.mkdir(parents=True)
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    script = textwrap.dedent(READ_FIFO.format(out=str(tmp_path)))
    # The bound is the test's, not the trainer's: the reader must not wait at all.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    line = f"UnreadableFile step 0: rollouts for rank 0: {path}: not a regular file (a micro-batch file is one)"
    assert proc.stdout.strip() == line, (proc.stdout, proc.stderr[-2000:])


@pytest.mark.integration
def test_a_step_without_a_loss_token_leaves_the_weights_as_they_were(tiny_model_dir, tmp_path):
    """Its gradient is zero, but AdamW's moments (of step 0) and weight decay moved every weight (by 7e-7 here)."""

    def batches_of(step):
        out = make_step_batches(step, 4, 2, 32, 96)
        for mb in out if step == 1 else []:
            mb.loss_mask[:] = False
        return out

    write_rollouts(tmp_path, steps=2, num_ranks=1, batches_of=batches_of)
    from tests.trainer.test_rl_trainer import trainer_args

    proc = run_cli(trainer_args(tiny_model_dir, tmp_path, 2))
    m = read_trainer_metrics(tmp_path)
    assert m[1]["loss_tokens"] == 0 and m[1]["optim/skipped"] == 1, m[1]
    assert "step 1: no loss token on any rank (every loss_mask of the step is 0): optimizer step skipped" in (
        proc.stdout + proc.stderr
    )
    run = RunDir(tmp_path)
    a, b = load_weights(run.weight_step(1)), load_weights(run.weight_step(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_written_file_reads_back(tmp_path):
    """The reader's own writer: unchanged."""
    path = tmp_path / "rank_0.safetensors"
    mbs = make_step_batches(0, 2, 2, 32, 96)
    write_microbatches(path, RolloutBatchMeta(step=0, rank=0, num_micro_batches=2, seq_len=32), mbs)
    from prime_core.schemas.microbatch import read_microbatches

    _, back = read_microbatches(path)
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(mbs, back, strict=True))


def test_the_zmq_transport_checks_its_batches_the_same_way(tmp_path):
    from prime_core.transport import make_sender

    from tests.orchestrator.test_transport_zmq import free_base_port

    port = free_base_port()
    args = ["--output-dir", str(tmp_path), "--transport.type", "zmq", "--transport.base-port", str(port)]
    rollouts = RolloutSource(load_config(TrainerConfig, args), World(0, 1, 0, torch.device("cpu")))
    sender = make_sender(load_config(TrainerConfig, args).transport, RunDir(tmp_path), 1)
    try:
        mbs = make_step_batches(0, 2, 2, 32, 96)
        mbs[1].loss_mask[0, 0] = True
        sender.send(0, 0, RolloutBatchMeta(step=0, rank=0, num_micro_batches=2, seq_len=32), mbs)
        line = "step 0: rollouts for rank 0 (zmq transport): micro-batch 1 loss_mask[0, 0] is set on a sample's first"
        with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}"):
            rollouts.get(0, vocab_size=96)
    finally:
        sender.drain_timeout = 0
        sender.close()
        rollouts.close()
