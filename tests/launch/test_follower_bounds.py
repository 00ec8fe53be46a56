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


def test_the_end_of_run_summary_holds_only_its_values_not_the_whole_metrics_file(tmp_path):
    """A long run's metrics.jsonl was parsed whole into records at the end of the run (gigabytes after days): the
    summary reads one record at a time and keeps its few series."""
    import json
    import tracemalloc

    from prime_launch.metrics import summarize

    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(3000):
            extra = {f"env/metric_{i}": float(i) for i in range(40)}
            orch = {"reward/mean": step / 3000, **extra, **({"eval/e/reward/mean": 0.5} if step % 1000 == 0 else {})}
            f.write(json.dumps({"process": "orchestrator", "step": step, "values": orch}) + "\n")
            f.write(json.dumps({"process": "trainer", "step": step, "values": {"loss/mean": 0.1, **extra}}) + "\n")
    tracemalloc.start()
    try:
        summary = summarize(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert summary["trainer_steps"] == 3000 and summary["rollout_steps"] == 3000
    assert summary["evals"] == {"e": (0, 0.5, 2000, 0.5)} and summary["loss_last"] == 0.1
    assert peak < 4 * 2**20, f"summarizing a {path.stat().st_size >> 20} MiB file peaked at {peak >> 20} MiB"
