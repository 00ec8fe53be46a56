"""The launcher's live line follows metrics.jsonl for the whole run: what it keeps must not grow with the names an
environment chooses for its metrics."""

from __future__ import annotations

from prime_core.schemas.metrics import MetricsRecord
from prime_launch.metrics import MetricsFollower, format_run_line


def test_the_live_line_keeps_only_what_it_shows_of_a_run_logging_a_new_metric_name_every_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    with path.open("a") as f:
        for step in range(500):
            values = {"reward/mean": 0.5, f"eval/env/metric_{step}": 1.0, f"env_metric_{step}": 2.0}
            f.write(MetricsRecord(step=step, process="orchestrator", values=values).model_dump_json() + "\n")
            f.write(MetricsRecord(step=step, process="trainer", values={"loss/mean": 0.1}).model_dump_json() + "\n")
    follower.poll()
    assert sum(len(v) for v in follower.latest.values()) == 2, {k: len(v) for k, v in follower.latest.items()}
    assert follower.latest_step == {"orchestrator": 499, "trainer": 499}
    assert "reward 0.5" in format_run_line("run", follower) and "loss 0.1" in follower.line(500, 1.0)
