"""Rollouts the trainer receives that no model of its own could have produced: a token id past its vocabulary (an
orchestrator serving another model, a file written by another tool). One line naming the step, rank and micro-batch;
never the embedding's IndexError traceback (a device-side assert that takes the CUDA context down on a GPU)."""

import re

from prime_core.run_dir import RunDir

from tests.trainer.trainer_utils import make_step_batches, train_two_steps_and_fail, write_rollouts


def test_a_token_id_past_the_vocabulary_is_one_line_naming_step_rank_and_micro_batch(tiny_model_dir, tmp_path):
    def batches_of(step):
        out = make_step_batches(step, 4, 2, 32, 96)
        if step == 1:
            out[2].input_ids[1, 5] = 96 + 1000  # the tiny model's vocabulary is 96
        return out

    write_rollouts(tmp_path, steps=2, num_ranks=1, batches_of=batches_of)
    last = train_two_steps_and_fail(tiny_model_dir, tmp_path)
    assert last == (
        "error: step 1: rollouts for rank 0 (rollouts/step_1/rank_0): micro-batch 2 holds token id 1096, outside "
        "the model's vocabulary of 96 (rollouts of another model or tokenizer?)"
    ), last


def test_a_rollout_file_of_another_step_is_one_line_not_trained_as_this_one(tmp_path):
    import pytest
    import torch
    from prime_core.config import load_config
    from prime_core.config.trainer import TrainerConfig
    from prime_core.io import UnreadableFile
    from prime_trainer.rl.data import RolloutSource
    from prime_trainer.world import World

    write_rollouts(tmp_path, steps=2, num_ranks=1, micro_batches_per_step=2)
    run = RunDir(tmp_path)
    run.rollout_file(0, 0).replace(run.rollout_file(1, 0))  # step 0's file copied over step 1's
    config = load_config(TrainerConfig, ["--output-dir", str(tmp_path), "--data.wait-timeout-s", "5"])
    source = RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    line = "step 1: rollouts for rank 0 (rollouts/step_1/rank_0): the file is of step 0"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        source.get(1)


def _source(tmp_path):
    import torch
    from prime_core.config import load_config
    from prime_core.config.trainer import TrainerConfig
    from prime_trainer.rl.data import RolloutSource
    from prime_trainer.world import World

    config = load_config(TrainerConfig, ["--output-dir", str(tmp_path), "--data.wait-timeout-s", "5"])
    return RolloutSource(config, World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def test_a_rollout_file_of_another_launch_is_one_line_naming_both(tmp_path, monkeypatch):
    """Two runs sharing an output directory (or a file an earlier launch left at a step's path): before, the trainer
    trained on the other run's batch of the same step and rank. The orchestrator stamps its launch's ``PRIME_RUN_ID``
    into the file; the trainer refuses another's, and takes its own (a resumed launch writes its steps again)."""
    import pytest
    from prime_core.io import UnreadableFile
    from prime_core.schemas.microbatch import read_microbatches, write_microbatches

    write_rollouts(tmp_path, steps=2, num_ranks=1, micro_batches_per_step=2)
    path = RunDir(tmp_path).rollout_file(1, 0)
    meta, mbs = read_microbatches(path)
    write_microbatches(path, meta.model_copy(update={"run_id": "launch-a"}), mbs)

    monkeypatch.setenv("PRIME_RUN_ID", "launch-b")
    source = _source(tmp_path)
    source.get(0)  # a file of no launch (a standalone orchestrator's, an older one's) is taken
    line = (
        f"step 1: rollouts for rank 0: {path} was written by launch 'launch-a', this trainer's launch is 'launch-b' "
        "(another run writing to this output directory, or a file an earlier launch left)"
    )
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        source.get(1)

    monkeypatch.setenv("PRIME_RUN_ID", "launch-a")
    meta, got = _source(tmp_path).get(1)
    assert meta.run_id == "launch-a" and len(got) == 2
