"""A real `rl` run (the reverse-text example on CPU, shortened, evals off; slow) whose trainer is killed while it
publishes weights, then resumed: what the killed writes left under temporary names is gone, and metrics.jsonl holds
each step of each process once (the stopped run's records of the steps made again are in metrics.stopped.jsonl)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e.test_reverse_text import _find, _process_tree, without_evals
from tests.faults.test_rl_faults import MAX_STEPS, assert_nothing_left, finish, resume_to_the_end, start_run

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.xdist_group("multiprocess"),
              pytest.mark.timeout(2400)]  # fmt: skip


def publishing(out) -> bool:
    """Weights of step 3 or later being written under their temporary name (a checkpoint of step 2 exists by then)."""
    weights = out / "weights"
    names = [p.name for p in weights.iterdir()] if weights.is_dir() else []
    return any(n.startswith(".step_") and n.endswith(".tmp") and int(n.split(".")[1][5:]) >= 3 for n in names)


def test_a_trainer_killed_while_it_publishes_resumes_with_each_step_once(tmp_path):
    out, config = tmp_path / "run", without_evals(tmp_path)
    proc = start_run(out, config)
    try:
        while not publishing(out):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        tree = _process_tree(proc.pid)
        os.kill(_find(tree, "trainer"), signal.SIGKILL)
        _, err, _ = finish(proc, time.monotonic(), 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "trainer was killed by SIGKILL" in err, err
    assert_nothing_left(tree)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*.tmp"))
    print(f"the kill left {left}")
    resume_to_the_end(out, config)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.tmp")) == []
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["process"], r["step"]) for r in records]
    assert sorted(keys) == sorted({(p, s) for p in ("orchestrator", "trainer") for s in range(MAX_STEPS)}), keys
