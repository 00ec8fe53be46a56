"""examples/distill_reverse_text/rl.toml with the real ``rl``: four processes (policy server, the teacher rl starts
from ``[teacher]``, orchestrator, trainer) run 2 steps of on-policy distillation on CPU. The teacher scores every step,
checks out against the student's tokenizer at start, is watched and stopped like the others, and never changes its
weights while the policy's server takes each new step."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from prime_core.progress import read_progress

from tests.e2e.test_examples import metrics
from tests.tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
RL = Path(sys.executable).with_name("rl")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
def test_distill_example_runs_two_steps_with_the_started_teacher(tmp_path):
    out = tmp_path / "run"
    cmd = [str(RL), "@", str(ROOT / "examples/distill_reverse_text/rl.toml"), "--output-dir", str(out)]
    cmd += ["--max-steps", "2", "--orchestrator.eval.envs", "[]", "--console", "quiet"]
    cmd += ["--inference.server.port", str(free_port()), "--teacher.port", str(free_port())]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(f"examples/distill_reverse_text/rl.toml, 2 steps: {time.monotonic() - start:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rl: teacher is healthy" in result.stdout
    found = metrics(out)
    assert sorted(found["trainer"]) == sorted(found["orchestrator"]) == [0, 1]
    for step in found["orchestrator"].values():
        assert step["time/teacher_scoring"] > 0 and step["filtered/groups"] == 0
        assert step["distill/reverse-text/reverse_kl"] > 0  # the student is not the teacher yet
    teacher = tomllib.loads((out / "configs" / "teacher.toml").read_text())
    assert teacher["server"]["frozen"] and teacher["engine"] == "torch"
    assert "serving" in (out / "logs" / "teacher.log").read_text()
    # The policy's server took the trainer's steps; the teacher served its starting weights throughout.
    assert read_progress(out / "teacher" / "progress" / "inference.json").counters["weight_step"] == 0
    assert read_progress(out / "progress" / "inference.json").counters["weight_step"] >= 1
