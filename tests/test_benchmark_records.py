"""Benchmark records say which code ran and only carry numbers of the run they describe."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """A benchmark module by file (benchmarks/ is no package; its scripts import each other by bare name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tree_commit_is_unknown_for_an_exported_tree(tmp_path):
    tree_commit = load("provenance").tree_commit
    outer = tmp_path / "outer"
    (outer / "export" / "benchmarks").mkdir(parents=True)
    git(outer, "init", "-q")
    (outer / "README").write_text("another project\n")
    git(outer, "add", "README")
    git(outer, "commit", "-qm", "outer")
    # A copy of the tree inside another repository: git would report the outer HEAD.
    assert tree_commit(root=outer / "export") == "unknown"
    assert tree_commit(root=outer) == git(outer, "rev-parse", "--short", "HEAD")
    assert tree_commit("abc123", root=outer / "export") == "abc123"  # --commit / PRIME_COMMIT
    assert tree_commit(root=tmp_path / "nowhere") == "unknown"


def write_metrics(run: Path, steps: int, dt: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"process": "trainer", "step": s, "time": s * dt, "values": {"time/step": dt}} for s in range(steps)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def fake_rl(tmp_path: Path, code: int, steps: int = 0) -> list[str]:
    """A stand-in for `rl` that writes ``steps`` trainer records 2 s apart into the run dir, then exits ``code``."""
    script = tmp_path / f"rl_{code}_{steps}.py"
    script.write_text(
        "import json, sys, pathlib\n"
        "run = pathlib.Path(sys.argv[1]); run.mkdir(parents=True, exist_ok=True)\n"
        f"recs = [dict(process='trainer', step=s, time=2.0 * s, values={{}}) for s in range({steps})]\n"
        "(run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in recs)) if recs else None\n"
        f"sys.exit({code})\n"
    )
    return [sys.executable, str(script)]


def test_rl_gpu_reports_no_step_times_of_a_previous_run(tmp_path):
    run_level = load("rl_gpu").run_level
    run = tmp_path / "async0"
    write_metrics(run, steps=8, dt=0.5)  # a previous, successful run's records
    failed = run_level([*fake_rl(tmp_path, code=2), str(run)], run, 0)
    assert failed["returncode"] == 2 and failed["steps"] == 0
    assert "step_wall_median_s" not in failed and "rl exited with code 2" in failed["error"]
    partial = run_level([*fake_rl(tmp_path, code=1, steps=3), str(run)], run, 0)
    assert partial["steps"] == 3 and "step_wall_s" not in partial
    ok = run_level([*fake_rl(tmp_path, code=0, steps=4), str(run)], run, 0)
    assert ok["returncode"] == 0 and ok["steps"] == 4 and ok["step_wall_s"] == [2.0, 2.0, 2.0]


def test_rl_gpu_timeline_lines_up_the_processes(tmp_path):
    """The loop's timeline: each step's dispatch, results, ship and the trainer's receive/compute/publish, in
    seconds from the first trainer step's start."""
    trainer = {s: {"time/received_at": 100.0 + 4 * s, "time/step": 2.5, "time/published_at": 102.8 + 4 * s}
               for s in range(2)}  # fmt: skip
    orchestrator = {1: {"time": 103.7, "time/dispatched_at": 99.0, "time/policy_served_at": 98.9,
                        "time/rollouts_admitted": 0.5, "time/rollouts_first_done": 3.0,
                        "time/rollouts_half_done": 3.5, "time/rollouts": 4.5}}  # fmt: skip
    rows = load("rl_gpu").timeline(trainer, orchestrator)
    assert rows[0] == {"step": 0, "weights_served": None, "dispatched": None, "shipped": None,
                       "trainer_received": 0.0, "trainer_computed": 2.5, "trainer_published": 2.8}  # fmt: skip
    assert rows[1] == {"step": 1, "weights_served": -1.1, "dispatched": -1.0, "admitted": -0.5, "first_done": 2.0,
                       "half_done": 2.5, "last_done": 3.5, "shipped": 3.7, "trainer_received": 4.0,
                       "trainer_computed": 6.5, "trainer_published": 6.8}  # fmt: skip
    assert load("rl_gpu").timeline({0: {"time/step": 1.0}}, {}) == []  # records of before the timeline
