"""A FIFO at a run's ``metrics.jsonl`` (left by a user, or a tool that tailed the run through one): the launcher read
it to see whether the run trained, and to set a stopped run's records aside on ``--resume``, and every process
appends to it; each ``open`` waited for good for a writer or reader that never came, with nothing on the console."""

from __future__ import annotations

import os
import subprocess

import pytest
from prime_core.io import mark_stable
from prime_core.run_dir import RunDir

from tests.launch.test_rl_launcher import rl_cmd


def _rl(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("rl was still running after 120 s (killed)")


@pytest.mark.parametrize(
    ("name", "resume"),
    [("metrics.jsonl", False), ("metrics.jsonl", True), ("metrics.stopped.jsonl", True)],
    ids=["fresh", "resume", "stopped_resume"],
)
def test_a_fifo_at_metrics_jsonl_is_refused_in_one_line_before_anything_starts(tmp_path, rl_env, name, resume):
    """``metrics.stopped.jsonl``: ``--resume`` appends the stopped run's redone records to it (an ``open`` for writing
    of a FIFO waits for a reader)."""
    out = tmp_path / "run"
    first = _rl(rl_cmd(out), rl_env)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    run = RunDir(out)
    if resume:  # a checkpoint to resume from, as in test_resume_leftovers
        for path in (run.trainer_checkpoint(2), run.orchestrator_checkpoint(2), run.weight_step(2)):
            path.mkdir(parents=True)
            mark_stable(path)
        mark_stable(run.checkpoint_step(2))
    metrics = run.root / name
    metrics.unlink(missing_ok=True)
    os.mkfifo(metrics)
    proc = _rl(rl_cmd(out, *(["--resume"] if resume else [])), rl_env)
    line = f"{metrics} is not a regular file (the run appends its metrics to one): remove it, or pass --overwrite"
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {line}"], proc.stderr


def test_overwrite_replaces_a_fifo_at_metrics_jsonl(tmp_path, rl_env):
    out = tmp_path / "run"
    os.makedirs(out)
    os.mkfifo(RunDir(out).metrics)
    proc = _rl(rl_cmd(out, "--overwrite"), rl_env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert RunDir(out).metrics.is_file()


def test_a_fifo_at_the_models_config_json_does_not_block_the_launcher(tmp_path):
    """A model directory (downloaded, shared) with a FIFO under ``config.json``: the launcher's sizing read of it
    (``host.model_config``) waited in ``open`` for good. It now reads as no config (the preflight names the file)."""
    import sys
    import textwrap

    os.mkfifo(tmp_path / "config.json")
    code = textwrap.dedent(f"""
        from types import SimpleNamespace as N
        from prime_launch.host import model_config
        print(model_config(N(model=N(name={str(tmp_path)!r}), init=N(config_overrides={{}})), {{}}))
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("model_config was still waiting after 60 s (killed)")
    assert proc.stdout.strip() == "None", proc.stderr[-2000:]


def test_a_fifo_at_the_lock_file_is_named(tmp_path):
    """Before: ``error: File or stream is not seekable.`` (truncating the FIFO), naming no file."""
    from prime_launch.run_lock import LOCK_NAME, lock_output_dir

    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(FileExistsError) as e:
        lock_output_dir(tmp_path)
    assert str(e.value) == f"{tmp_path / LOCK_NAME} is not a regular file (rl's lock file is one): remove it"
