"""Small trainer pieces: lr schedules, rollout wait timeout, bench defaults, config help."""

import math

import pytest
import torch
from prime_core.config import load_config
from prime_core.config.trainer import CosineSchedulerConfig, SFTConfig, TrainerConfig
from prime_trainer.optim import lr_at
from prime_trainer.rl.data import RolloutSource
from prime_trainer.world import World


def test_schedules():
    cfg = TrainerConfig().scheduler.model_copy(update={"warmup_steps": 4})
    assert [lr_at(s, 1.0, cfg, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = CosineSchedulerConfig(warmup_steps=2, min_lr=0.1)
    assert lr_at(1, 1.0, cos, 12) == 1.0 and lr_at(2, 1.0, cos, 12) == pytest.approx(1.0)
    assert lr_at(11, 1.0, cos, 12) == pytest.approx(0.1)
    # Cosine over steps 2..11: step 6 is 4/9 of the way.
    assert lr_at(6, 1.0, cos, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))


def test_rollout_wait_timeout_names_the_step(tmp_path):
    config = load_config(TrainerConfig, ["--output-dir", str(tmp_path), "--data.wait-timeout-s", "0.2"])
    source = RolloutSource(config, World(rank=1, world_size=2, local_rank=1, device=torch.device("cpu")))
    with pytest.raises(RuntimeError, match=r"step 4: no rollouts for rank 1 after 0s .*rank_1"):
        source.get(4)


def test_bench_defaults_and_loss_union():
    cfg = load_config(TrainerConfig, ["--bench", "--loss.type", "cispo", "--data.fake.micro-batch-size", "2"])
    assert cfg.max_steps == 5 and cfg.data.fake.micro_batch_size == 2 and cfg.loss.clip_high == 0.28
    assert load_config(SFTConfig, ["--bench", "--max-steps", "3"]).max_steps == 3
    with pytest.raises(ValueError, match="data.path"):
        load_config(SFTConfig, [])


def test_settings_only_the_world_rejects_fail_in_one_line(tiny_model_dir, tmp_path):
    """A layout the world rejects (cp=2 on one process, ep on a dense model) stops the trainer with one line naming
    the key, not a traceback."""
    import os
    import subprocess
    import sys

    common = ["--bench", "--model.name", str(tiny_model_dir), "--init.random", "--max-steps", "1", "--seq-len", "64"]
    for extra, key in ((["--model.cp", "2"], "model.cp=2"), (["--model.ep", "2"], "model.ep=2")):
        cmd = [
            sys.executable,
            "-m",
            "prime_trainer.entrypoints.trainer",
            *common,
            *extra,
            "--output-dir",
            str(tmp_path),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {key}"), proc.stderr[-2000:]


def test_vocab_size_of_text_and_vision_language_sources():
    """Fake data and multi-run steps read the vocabulary from the model source: VLM configs nest it in text_config."""
    from prime_models.tiny import tiny_qwen3_vl_config
    from prime_trainer.model import ModelSource

    vl = tiny_qwen3_vl_config(vocab_size=300).to_dict()
    assert "vocab_size" not in vl
    assert ModelSource(hf_config=vl, tokenizer="", random_init=True).vocab_size == 300
    assert ModelSource(hf_config={"vocab_size": 128}, tokenizer="", random_init=True).vocab_size == 128


@pytest.mark.parametrize("world_size", [None, "2"])
def test_a_clean_finish_exits_without_finalizing_on_any_number_of_ranks(monkeypatch, world_size):
    """One rank too: `rl` waits for the trainer's exit, and Python's teardown of torch took 2 s of each run's end.
    A train that fails still leaves through its error (no exit 0)."""
    import prime_core.progress
    import prime_trainer.entrypoints as entrypoints
    import prime_trainer.world

    calls = []
    monkeypatch.setattr(entrypoints, "exit_without_finalizing", lambda: calls.append("exit"))
    monkeypatch.setattr(prime_trainer.world, "shutdown_world", lambda wait_for_peers: calls.append(wait_for_peers))
    monkeypatch.setattr(prime_core.progress, "stop_reporting", lambda: None)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    entrypoints.run_training(lambda config: None, config=None)
    assert calls == [True, "exit"]

    calls.clear()

    def fails(config):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        entrypoints.run_training(fails, config=None)
    assert calls == [False]


def test_ctrl_c_of_a_trainer_on_its_own_is_one_line_naming_the_checkpoint_to_resume(tmp_path, capsys):
    """``sft`` interrupted with Ctrl-C printed a KeyboardInterrupt traceback from inside the step it was in."""
    import prime_trainer.entrypoints as entrypoints
    from prime_core.config.shared import CheckpointConfig
    from prime_core.io import mark_stable

    def interrupted(config):
        raise KeyboardInterrupt

    config = SFTConfig.model_construct(output_dir=tmp_path, ckpt=CheckpointConfig(interval=5))
    for step in (5, 10):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    mark_stable(tmp_path / "checkpoints" / "step_5")  # step 10 was being written
    with pytest.raises(SystemExit) as e:
        entrypoints.run_training(interrupted, config)
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == "sft: interrupted (SIGINT); resume from its newest checkpoint with --ckpt.resume-step 5\n"
    bare = TrainerConfig.model_construct(output_dir=tmp_path / "none", ckpt=CheckpointConfig())
    assert entrypoints.interrupted_line(bare) == (
        "trainer: interrupted (SIGINT); it saved no checkpoint to resume from (ckpt.interval is unset)"
    )
