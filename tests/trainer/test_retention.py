"""What the trainer keeps on disk over a long run: consumed rollout files and old checkpoints are deleted, so that the
run directory holds a bounded number of step directories however many steps run."""

import torch
from prime_core.config import load_config
from prime_core.config.shared import CheckpointConfig
from prime_core.config.trainer import TrainerConfig
from prime_core.io import mark_stable
from prime_core.run_dir import RunDir
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.rl.data import RolloutSource
from prime_trainer.world import World

from tests.trainer.trainer_utils import write_rollouts


def sources(out, *extra: str, ranks: int = 2) -> list[RolloutSource]:
    config = load_config(TrainerConfig, ["--output-dir", str(out), "--data.wait-timeout-s", "5", *extra])
    cpu = torch.device("cpu")
    return [RolloutSource(config, World(rank=r, world_size=ranks, local_rank=r, device=cpu)) for r in range(ranks)]


def test_consumed_rollouts_are_deleted_once_every_rank_read_them(tmp_path):
    run = RunDir(tmp_path)
    write_rollouts(tmp_path, steps=12, num_ranks=2, micro_batches_per_step=2)
    rank0, rank1 = sources(tmp_path)
    for step in range(10):
        rank0.get(step)
        # Rank 1 has not read step 7 yet: the step directory stays, with rank 1's file and only that.
        if step == 9:
            assert run.rollout_steps() == [7, 8, 9, 10, 11]
            assert sorted(p.name for p in run.rollout_step(7).iterdir()) == ["rank_1.safetensors"]
        rank1.get(step)
    # Default keep_rollouts = 2: the two newest consumed steps, and the two not yet read.
    assert run.rollout_steps() == [8, 9, 10, 11]


def test_a_resumed_trainer_deletes_what_the_stopped_run_left_before_its_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    write_rollouts(tmp_path, steps=30, num_ranks=1, micro_batches_per_step=1)
    (source,) = sources(tmp_path, "--data.keep-rollouts", "1", ranks=1)
    source.get(20)
    assert run.rollout_steps() == list(range(20, 30))


def test_keep_rollouts_unset_keeps_every_step(tmp_path):
    write_rollouts(tmp_path, steps=4, num_ranks=1, micro_batches_per_step=1)
    (source,) = sources(tmp_path, "--data.keep-rollouts", "None", ranks=1)
    for step in range(4):
        source.get(step)
    assert RunDir(tmp_path).rollout_steps() == [0, 1, 2, 3]


def fake_checkpoint(run: RunDir, step: int, orchestrators: list[RunDir]) -> None:
    """The files a saved checkpoint leaves: the trainer's part and its markers, each orchestrator's part."""
    for part in [run.trainer_checkpoint(step), *(o.orchestrator_checkpoint(step) for o in orchestrators)]:
        part.mkdir(parents=True)
        (part / "progress.json").write_text("{}")
        mark_stable(part)
    mark_stable(run.checkpoint_step(step))


def test_ckpt_keep_leaves_that_many_step_directories_with_the_orchestrators_parts(tmp_path):
    run = RunDir(tmp_path)
    manager = CheckpointManager(CheckpointConfig(interval=10, keep=2), run, World(0, 1, 0, torch.device("cpu")))
    for step in range(10, 110, 10):
        fake_checkpoint(run, step, [run])
        manager._cleanup()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_100", "step_90"]
    assert run.resumable_steps() == [] and run.checkpoint_steps() == [90, 100]


def test_ckpt_keep_of_a_multi_tenant_trainer_deletes_each_runs_orchestrator_part(tmp_path):
    trainer_dir, runs = RunDir(tmp_path / "trainer"), [RunDir(tmp_path / "a"), RunDir(tmp_path / "b")]
    manager = CheckpointManager(CheckpointConfig(interval=1, keep=1), trainer_dir, World(0, 1, 0, torch.device("cpu")))
    manager.run_dirs = runs
    for step in range(1, 6):
        fake_checkpoint(trainer_dir, step, runs)
        manager._cleanup()
    for run in (trainer_dir, *runs):
        assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_5"]
