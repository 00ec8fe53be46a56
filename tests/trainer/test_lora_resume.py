"""Resuming with LoRA settings other than the checkpoint's (LoRA added, removed, rank, alpha or target modules
changed) used to build the model and fail in DCP's load ~17 s later with "Missing key ... lora_A" (a traceback, exit
1). Now it is one line naming the setting and what the checkpoint has: at parse when the checkpoint records its LoRA
settings, at load (before DCP reads a byte) for a checkpoint saved before they were recorded."""

import json
import subprocess
import sys

import pytest
from prime_core.run_dir import RunDir

from tests.trainer.test_lora_trainer import COMMON, LORA, base_dir, save_base  # noqa: F401 - the fixture
from tests.trainer.trainer_utils import run_cli, write_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess")]


def resume(base, out, *extra) -> subprocess.CompletedProcess:
    argv = ["--model.name", str(base), "--output-dir", str(out), "--max-steps", "3", *COMMON, "--ckpt.resume-step", "2"]
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer", *argv, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    return proc.stderr.strip()


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("lora-run")
    write_rollouts(out, steps=3, num_ranks=1)
    run_cli(["--model.name", str(base_dir), "--output-dir", str(out), "--max-steps", "2", *COMMON, *LORA,
             "--ckpt.interval", "2"])  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ([], "was trained with model.lora (rank = 4, alpha = 8.0, target_modules = "),
        (["--model.lora.rank", "8", "--model.lora.alpha", "8"], "model.lora.rank = 4 but this run sets 8"),
        (["--model.lora.rank", "4", "--model.lora.alpha", "16"], "model.lora.alpha = 8.0 but this run sets 16.0"),
        ([*LORA, "--model.lora.target-modules", '["q_proj"]'], "model.lora.target_modules = ['down_proj', "),
    ],
)
def test_other_lora_settings_than_the_checkpoints_are_one_line_at_parse(base_dir, lora_run, extra, why):  # noqa: F811
    err = one_line(resume(base_dir, lora_run, *extra))
    assert err.startswith("error: CLI --ckpt.resume-step: ckpt.resume-step: checkpoint step 2 in "), err
    assert why in err, err
    assert "no model" not in err


def test_a_checkpoint_without_the_record_names_the_difference_at_load(base_dir, lora_run, tmp_path):  # noqa: F811
    """A checkpoint saved before progress.json recorded LoRA: the trainable keys and shapes are compared with the
    model's before DCP loads."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(lora_run, old)
    progress = RunDir(old).trainer_checkpoint(2) / "progress.json"
    progress.write_text(json.dumps({k: v for k, v in json.loads(progress.read_text()).items() if k != "lora"}))
    err = one_line(resume(base_dir, old, "--model.lora.rank", "8", "--model.lora.alpha", "8"))
    assert err.startswith(f"error: checkpoint step 2 in {old} holds model.layers.0."), err
    assert "lora_A" in err and "(model.lora.rank changed?)" in err
    err = one_line(resume(base_dir, old, "--model.lora.rank", "4", "--model.lora.alpha", "16"))
    assert err.endswith("holds the adapters ['r4-a8'], this run ['r4-a16'] (model.lora.name, runs, or the default "
                        "name r<rank>-a<alpha>)"), err  # fmt: skip
    err = one_line(resume(base_dir, old))
    assert (
        err == f"error: checkpoint step 2 in {old} holds LoRA adapters (trained with model.lora) but this run sets none"
    )
    err = one_line(resume(base_dir, old, *LORA, "--model.lora.target-modules", '["q_proj"]'))
    assert "model.lora.target_modules changed?" in err, err


def test_a_full_weight_checkpoint_resumed_with_lora_is_one_line(base_dir, tmp_path):  # noqa: F811
    out = tmp_path / "full"
    write_rollouts(out, steps=3, num_ranks=1)
    run_cli(
        ["--model.name", str(base_dir), "--output-dir", str(out), "--max-steps", "2", *COMMON, "--ckpt.interval", "2"]
    )
    err = one_line(resume(base_dir, out, *LORA))
    assert err.endswith("was trained without model.lora (full weights, no adapters) but this run sets model.lora: "
                        "resume with the checkpoint's LoRA settings, or start afresh in another --output-dir"), err  # fmt: skip


def test_the_same_lora_settings_resume(base_dir, lora_run, tmp_path):  # noqa: F811
    import shutil

    again = tmp_path / "again"
    shutil.copytree(lora_run, again)
    run_cli(["--model.name", str(base_dir), "--output-dir", str(again), "--max-steps", "3", *COMMON, *LORA,
             "--ckpt.resume-step", "2"])  # fmt: skip
    assert RunDir(again).stable_weight_steps()[-1] == 3
