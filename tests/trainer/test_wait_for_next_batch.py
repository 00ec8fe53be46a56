"""`data.wait_for_next_batch`: step n starts only once step n + 1's rollouts are in (trainer and inference take turns
on a shared GPU); the steps it trains are the same."""

import subprocess
import sys

import pytest
from prime_core.run_dir import RunDir

from tests.trainer.test_rl_trainer import trainer_args
from tests.trainer.trainer_utils import read_trainer_metrics, run_cli, write_rollouts

pytestmark = [pytest.mark.integration]

WAIT = ["--data.wait-for-next-batch", "true"]


def test_same_steps_as_without_waiting(tiny_model_dir, tmp_path):
    plain, turns = tmp_path / "plain", tmp_path / "turns"
    for out in (plain, turns):
        write_rollouts(out, steps=3, num_ranks=1)
    run_cli(trainer_args(tiny_model_dir, plain, 3))
    # The last step has no next batch to wait for: a short bound fails the run if it waited anyway.
    run_cli(trainer_args(tiny_model_dir, turns, 3, *WAIT, "--data.wait-timeout-s", "20"))

    a, b = read_trainer_metrics(plain), read_trainer_metrics(turns)
    assert sorted(b) == [0, 1, 2]
    assert [a[s]["loss/mean"] for s in range(3)] == [b[s]["loss/mean"] for s in range(3)]
    assert RunDir(turns).stable_weight_steps() == RunDir(plain).stable_weight_steps()


def test_step_waits_for_the_next_batch_before_training(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    write_rollouts(out, steps=1, num_ranks=1)  # step 1's rollouts never come
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer",
           *trainer_args(tiny_model_dir, out, 3, *WAIT, "--data.wait-timeout-s", "3")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    assert proc.returncode != 0
    assert "no rollouts for rank 0" in proc.stderr and "step 1" in proc.stderr
    # Step 0 was not trained: its weights (step 1) were never published.
    assert 1 not in RunDir(out).stable_weight_steps()
    assert read_trainer_metrics(out) == {}


def test_needs_async_level_one(tiny_model_dir, tmp_path):
    args = trainer_args(tiny_model_dir, tmp_path / "run", 2, *WAIT)
    at = args.index("--async-level")
    args[at + 1] = "0"
    proc = subprocess.run([sys.executable, "-m", "prime_trainer.entrypoints.trainer", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "data.wait_for_next_batch needs async_level >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
