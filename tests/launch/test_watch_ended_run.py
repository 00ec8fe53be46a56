"""``prime-launch watch`` pointed at a run that had already ended: before, it ignored the records written before it
started and named the orchestrator as stuck a minute later (exit 1) even for a run that had finished. The records here
are written by real ``ProgressReporter``s in processes that then exit, as the trainer and orchestrator do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prime_core.config.liveness import LivenessConfig, WatchConfig
from prime_core.io import mark_stable
from prime_core.run_dir import RunDir
from prime_launch.watchdog import ProcessStuck, RunEnded, watch_forever

CLI = [sys.executable, "-m", "prime_launch.entrypoints.cli"]
WRITER = """
import os, sys
from prime_core.progress import ProgressReporter
from prime_core.run_dir import RunDir
run, how = RunDir(sys.argv[1]), sys.argv[2:]
for name, rank, end in [("orchestrator", None, how[0]), ("trainer", 0, how[1])]:
    if end == "never":
        continue
    r = ProgressReporter(run.progress_file(name, rank), name, rank=rank, run_id=os.environ.get("PRIME_RUN_ID")).start()
    r.set_step(3)
    if end == "crash":
        r.begin("training step 3", kind="step")
        r.write()
    else:
        r.close()
"""


def write_run(root: Path, orchestrator: str, trainer: str, run_id: str = "job-1") -> RunDir:
    """Records as the processes leave them: ``close`` (finished its work), ``crash`` (gone mid-step) or ``never``
    (stopped before it started)."""
    env = {**os.environ, "PRIME_RUN_ID": run_id}
    subprocess.run([sys.executable, "-c", WRITER, str(root), orchestrator, trainer], env=env, check=True, timeout=60)
    return RunDir(root)


def watch(root: Path, run_id: str | None = None) -> None:
    config = WatchConfig(output_dir=root, liveness=LivenessConfig(startup_s=1, slack_s=1))
    env = os.environ.pop("PRIME_RUN_ID", None)
    if run_id:
        os.environ["PRIME_RUN_ID"] = run_id
    try:
        watch_forever(config, poll_s=0.1)
    finally:
        os.environ.pop("PRIME_RUN_ID", None)
        if env is not None:
            os.environ["PRIME_RUN_ID"] = env


def test_a_finished_run_is_named_finished_and_exits_0(tmp_path):
    run = write_run(tmp_path, "close", "close")
    (run.weight_step(4)).mkdir(parents=True)
    mark_stable(run.weight_step(4))
    args = ["watch", "--output-dir", str(tmp_path), "--liveness.startup-s", "2"]
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"the run in {tmp_path} has finished: trainer exited after its work; final weights {run.weight_step(4)}; "
        "nothing to watch\n"
    )
    assert done.stderr == ""


def test_a_run_that_crashed_is_named_as_ended_before_it_finished(tmp_path):
    write_run(tmp_path, "crash", "crash")
    with pytest.raises(RunEnded) as e:
        watch(tmp_path)
    assert e.value.code == 1
    assert e.value.line.startswith(f"the run in {tmp_path} ended before it finished: trainer rank 0 (pid ")
    assert e.value.line.endswith(f"exited without finishing, while training step 3 (log: {tmp_path}/logs/trainer.log)")


def test_an_orchestrator_stopped_after_the_trainer_finished_is_a_finished_run(tmp_path):
    """A SLURM job stops every step once the trainer finished: the orchestrator then leaves no final record."""
    write_run(tmp_path, "crash", "close")
    with pytest.raises(RunEnded) as e:
        watch(tmp_path, run_id="job-1")
    assert e.value.code == 0 and "; orchestrator (pid " in e.value.line
    assert "exited without finishing, while training step 3 after the trainer finished; nothing to watch" in (
        e.value.line
    )


def test_records_of_the_job_before_a_resumed_one_are_still_waited_past(tmp_path):
    """A resumed SLURM job's watch starts beside processes that have not written yet: the stopped job's records
    (another ``PRIME_RUN_ID``) say nothing of this one, which is watched as before."""
    write_run(tmp_path, "close", "close", run_id="job-1")
    with pytest.raises(ProcessStuck, match="orchestrator is stuck: it wrote no heartbeat"):
        watch(tmp_path, run_id="job-2")


def test_a_run_stopped_before_its_trainer_started_is_named_by_its_orchestrator(tmp_path):
    """Ctrl-C of rl while inference loaded: the trainer never wrote a record, the orchestrator's is left."""
    write_run(tmp_path, "crash", "never")
    with pytest.raises(RunEnded) as e:
        watch(tmp_path)
    assert e.value.code == 1 and "ended before it finished: orchestrator (pid " in e.value.line


RL_TOML = Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "rl.toml"


def test_watch_takes_the_run_s_rl_config_and_its_flags(tmp_path):
    """``prime-launch watch @ rl.toml`` (and rl's flags) watches the run directory ``rl`` with the same arguments
    uses, with the run's ``[liveness]`` bounds; before, watch took ``--output-dir`` only (``@ rl.toml``: exit 2,
    unknown keys)."""
    run = write_run(tmp_path, "close", "close")
    run.weight_step(4).mkdir(parents=True)
    mark_stable(run.weight_step(4))
    args = ["watch", "@", str(RL_TOML), "--output-dir", str(tmp_path), "--liveness.startup-s", "2"]
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(f"the run in {tmp_path} has finished: trainer exited after its work;")


def test_watch_of_an_rl_config_finds_the_run_directory_rl_uses(capsys):
    import tomllib

    from prime_core.config import load_config
    from prime_core.config.rl import RLConfig
    from prime_launch.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["watch", "@", str(RL_TOML), "--trainer-ranks", "2", "--dry-run"])
    watched = tomllib.loads(capsys.readouterr().out)
    rl = load_config(RLConfig, ["@", str(RL_TOML)])
    assert e.value.code == 0
    assert (watched["output_dir"], watched["trainer_ranks"]) == (str(rl.run_dir), 2)
    assert watched["liveness"] == rl.liveness.model_dump(exclude_none=True)
    with pytest.raises(SystemExit) as e:  # the run's orchestrator is always watched; the flag is rl's section
        main(["watch", "@", str(RL_TOML), "--orchestrator", "false"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: CLI --orchestrator")
