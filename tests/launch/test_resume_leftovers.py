"""`rl --resume` after a kill in the middle of a write: what the killed writer was building under a temporary name
(weights being published, rollouts being shipped, a checkpoint part being saved) is removed before anything starts.
Before, each kill left one for ever: a full copy of the weights (16 GB for an 8B model) per crash of a long run."""

from __future__ import annotations

import json
import subprocess
import sys

from prime_core.io import mark_stable
from prime_core.run_dir import RunDir

from tests.launch.test_rl_launcher import rl_cmd


def test_resume_removes_what_a_killed_writer_left_under_a_temporary_name(tmp_path, rl_env):
    out = tmp_path / "run"
    first = subprocess.run(rl_cmd(out), env=rl_env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    run = RunDir(out)
    for path in (run.trainer_checkpoint(2), run.orchestrator_checkpoint(2), run.weight_step(2)):
        path.mkdir(parents=True)
        mark_stable(path)
    mark_stable(run.checkpoint_step(2))
    leftovers = [run.weights / ".step_3.k2j4ab.tmp", run.rollouts / ".step_4.x9q1zz.tmp",
                 run.checkpoint_step(4) / ".trainer.tmp", run.checkpoint_step(4) / ".orchestrator.a1b2c3.tmp"]  # fmt: skip
    for path in leftovers:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(bytes(1 << 20))
    kept = [run.weights / ".hidden-by-the-user", run.checkpoint_step(2) / "trainer" / "STABLE"]
    kept[0].write_text("not a writer's")
    resumed = subprocess.run(rl_cmd(out, "--resume"), env=rl_env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr
    assert "rl: resuming from step 2" in resumed.stdout
    assert [p for p in leftovers if p.exists()] == []
    assert all(p.exists() for p in kept)
    assert "the stopped run's 4 unfinished writes (4.0 MiB: checkpoints/step_4/.orchestrator.a1b2c3.tmp, " in \
        resumed.stdout, resumed.stdout  # fmt: skip


def test_rewind_moves_the_stopped_runs_metrics_of_the_redone_steps_aside(tmp_path):
    """The steps a resume makes again were logged by the stopped run too: metrics.jsonl held two records of each (the
    kill test's orchestrator step 2, with different rewards), a torn line between. They go to metrics.stopped.jsonl
    (kept, not lost); metrics.jsonl then has each step once."""
    run = RunDir(tmp_path)
    for path in (run.trainer_checkpoint(2), run.orchestrator_checkpoint(2), run.weight_step(2)):
        path.mkdir(parents=True)
        mark_stable(path)
    mark_stable(run.checkpoint_step(2))
    lines = [json.dumps({"step": s, "process": p, "time": 1.0, "values": {"x": s}}) for s in range(4)
             for p in ("orchestrator", "trainer")]  # fmt: skip
    torn = '{"step": 4, "process": "orchestr'
    run.metrics.write_text("\n".join([*lines, torn]))  # killed mid-append
    done = subprocess.run([sys.executable, "-m", "prime_launch.entrypoints.cli", "rewind", "--output-dir",
                           str(tmp_path), "--step", "2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert run.metrics.read_text() == "\n".join(lines[:4]) + "\n"
    assert (tmp_path / "metrics.stopped.jsonl").read_text() == "\n".join([*lines[4:], torn]) + "\n"
    assert "moved the stopped run's 5 metrics records of steps >= 2 to metrics.stopped.jsonl" in done.stdout, (
        done.stdout
    )
