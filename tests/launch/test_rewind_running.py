"""``prime-launch rewind`` on a run that is still running: before, it removed the live run's rollouts, weights and the
checkpoint its trainer was writing (that trainer died: FileNotFoundError in torch's checkpoint writer). It now refuses
in one line while ``rl`` holds the directory, or while a process of the run (started by hand or a SLURM job, no
``rl``) still beats, and leaves every file."""

from __future__ import annotations

import signal
import subprocess
import sys

from prime_core.io import mark_stable
from prime_core.progress import ProgressReporter
from prime_core.run_dir import RunDir

from tests.launch.test_rl_launcher import start_hanging_run

CLI = [sys.executable, "-m", "prime_launch.entrypoints.cli"]


def stopped_run_at(root) -> RunDir:
    run = RunDir(root)
    run.checkpoint_step(1).mkdir(parents=True)
    mark_stable(run.checkpoint_step(1))
    run.rollout_step(2).mkdir(parents=True)
    return run


def rewind(run: RunDir) -> subprocess.CompletedProcess:
    args = [*CLI, "rewind", "--output-dir", str(run.root), "--step", "1"]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_rewind_refuses_a_directory_rl_is_running_in(tmp_path, rl_env):
    run = RunDir(tmp_path / "run")
    proc = start_hanging_run(run.root, rl_env)
    try:
        stopped_run_at(run.root)
        done = rewind(run)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"output directory {run.root} is in use by another rl launch (pid {proc.pid} on " in done.stderr
    assert done.stderr.endswith("; rewind only a stopped run\n")
    assert run.rollout_step(2).is_dir()


def test_rewind_refuses_a_run_whose_processes_still_beat(tmp_path):
    run = stopped_run_at(tmp_path)
    beating = ProgressReporter(run.progress_file("trainer", 0), "trainer", rank=0).start()
    server = ProgressReporter(run.progress_file("inference"), "inference").start()  # kept up between launches
    try:
        done = rewind(run)
        beating.close()
        after = rewind(run)  # the trainer's final record says it finished: a stopped run
    finally:
        beating.close()
        server.close()
    assert done.returncode == 2
    assert done.stderr == (
        f"error: output-dir: trainer rank 0 (pid {beating.snapshot().pid}) of the run in {run.root} still running; "
        "rewind only a stopped run\n"
    )
    assert after.returncode == 0, after.stderr
    assert not run.rollout_step(2).exists()
