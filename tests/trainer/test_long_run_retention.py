"""A run of thousands of steps holds no per-step state in memory: what grows with the step count is only the record
on disk (metrics.jsonl). benchmarks/soak.py measures a real run's processes; these cases pin the causes it found."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prime_trainer.common import log_step


def components(bench: bool) -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(bench=bench),
        world=SimpleNamespace(is_master=True),
        monitor=None,
        logger=logging.getLogger("test_long_run_retention"),
        step_times=[],
    )


def test_a_training_run_holds_no_metrics_of_past_steps():
    c = components(bench=False)
    for step in range(2000):
        log_step(c, step, {"loss/mean": 0.1, "time/step": 1.0, "throughput/tokens_per_s": 10.0})
    assert len(c.step_times) == 0


def test_a_bench_run_still_keeps_every_step_for_its_summary():
    c = components(bench=True)
    for step in range(5):
        log_step(c, step, {"time/step": 1.0})
    assert [m["time/step"] for m in c.step_times] == [1.0] * 5


def test_a_bench_run_summarizes_every_step_after_the_warmup(tiny_model_dir, tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer", "--bench", "--model.name", str(tiny_model_dir)]
    cmd += ["--init.random", "--max-steps", "3", "--seq-len", "64", "--device", "cpu", "--output-dir", str(tmp_path)]
    cmd += ["--bench-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["steps_measured"] == 2
