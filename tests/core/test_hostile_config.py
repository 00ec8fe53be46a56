"""A careless or hostile user's way of starting runs: control characters in paths and sbatch fields, settings the
trainer only finds wrong once it loads, seeds no generator takes, config files that are not files. Each ends in one
line naming the field and exit 2, never a traceback or a script that runs what a value smuggled in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prime_core.config.trainer import TrainerConfig

from tests.core.test_bad_input import EXAMPLE, MODEL, REPO, error_line


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------- control characters


@pytest.mark.parametrize("bad", ["run\ntouch /tmp/pwned #", "run\x00", "run\rx"])
def test_a_path_with_a_control_character_is_refused(capsys, tmp_path, bad):
    """A NUL in ``output_dir`` used to end in os.stat's "embedded null byte" traceback; a newline went into the sbatch
    script's ``#SBATCH --output=`` line, and what followed it ran as a command of the job."""
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(tmp_path / bad))
    assert err.startswith("error: CLI --output-dir: output-dir: the path holds the control character ")
    (tmp_path / "t.toml").write_text(f"output_dir = {json.dumps(str(tmp_path / bad))}\n")  # JSON escapes are TOML's
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "@", str(tmp_path / "t.toml"))
    assert err.startswith(f"error: file {tmp_path}/t.toml: output-dir: the path holds the control character ")


def test_a_newline_in_an_sbatch_field_is_refused_and_no_script_is_written(tmp_path):
    """``--slurm.job-name $'x\\necho hi'`` used to put ``echo hi`` on a line of its own in the rendered script."""
    out = tmp_path / "run"
    for flag, value in (("--slurm.job-name", "x\necho hi"), ("--slurm.extra-sbatch", '["--a=1", "--b\\nrm -rf x"]')):
        proc = _run(
            "-m", "prime_launch.entrypoints.cli", "slurm", "rl", "@", str(EXAMPLE), "--output-dir", str(out), flag,
            value, "--dry-run",
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: CLI {flag}: {flag[2:]}: holds the control character '\\n'"), proc.stderr
        assert proc.stderr.count("\n") == 1
    assert not (out / "slurm" / "rl.sbatch").exists()


# ---------------------------------------------------------------- what the trainer finds wrong once it loads


@pytest.mark.integration
def test_settings_the_trainer_refuses_once_it_loads_are_one_line(tmp_path):
    """``--model.dtype float16``, ``--device cuda`` on a host without one, ``--init.config-overrides`` on a model with
    weights: each used to be a ValueError traceback from rank 0 and exit 1."""
    common = ["-m", "prime_trainer.entrypoints.trainer", "--model.name", str(MODEL), "--output-dir", str(tmp_path)]
    cases = [
        (["--model.dtype", "float16"], "model.dtype='float16' is not supported for training"),
        (["--init.config-overrides", '{"hidden_size": 128}'], "init.config_overrides change the architecture"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "device='cuda' but no CUDA device is visible"))
    for argv, message in cases:
        proc = _run(*common, *argv)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: {message}") and "Traceback" not in proc.stderr, proc.stderr
