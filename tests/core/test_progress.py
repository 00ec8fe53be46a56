"""Heartbeat files (prime_core.progress) and the typed /health answer (prime_core.schemas.health)."""

from __future__ import annotations

import json
import logging
import time

from prime_core import progress
from prime_core.progress import ProgressReporter, read_progress
from prime_core.run_dir import RunDir
from prime_core.schemas.health import parse_health


def test_reporter_writes_heartbeats_lanes_and_learned_durations(tmp_path):
    path = RunDir(tmp_path).progress_file("trainer", rank=1)
    reporter = ProgressReporter(path, "trainer", rank=1, run_id="r1").start()
    try:
        with reporter.activity("training step 0", kind="step"):
            time.sleep(0.05)
        reporter.begin("waiting for rollouts of step 1", waits_for="orchestrator")
        reporter.begin("sending", lane="ship", limit_s=5)
        reporter.count("rollouts/x/done", 2)
        reporter.set_step(1)
        first = read_progress(path).time
        time.sleep(1.3)
        record = read_progress(path)
    finally:
        reporter.close()
    assert path.name == "trainer_rank_1.json" and record.name == "trainer rank 1" and record.run_id == "r1"
    assert record.time > first  # the background thread beats
    assert record.step == 1 and record.counters == {"rollouts/x/done": 2}
    assert record.slowest_s["step"] >= 0.05
    lanes = {a.lane: a for a in record.activities}
    assert lanes["main"].waits_for == "orchestrator" and lanes["ship"].limit_s == 5
    assert record.doing() == "waiting for rollouts of step 1; sending"
    final = read_progress(path)
    assert final.exiting and final.activities == [] and final.doing() == "exiting"


def test_touch_restarts_the_clock_of_a_lane(tmp_path):
    reporter = ProgressReporter(tmp_path / "p.json", "orchestrator")
    reporter.begin("generating rollouts (0 of 4 done for step 0)", lane="rollouts", limit_s=60)
    since = reporter.snapshot().activities[0].since
    time.sleep(0.02)
    reporter.touch("rollouts", "generating rollouts (1 of 4 done for step 0)")
    (activity,) = reporter.snapshot().activities
    assert activity.since > since and activity.what.startswith("generating rollouts (1 of 4")
    reporter.end("rollouts")
    assert reporter.snapshot().activities == [] and "rollouts" not in reporter.snapshot().slowest_s


def test_a_long_activity_is_logged_with_what_it_waits_for(tmp_path, caplog, monkeypatch):
    reporter = ProgressReporter(tmp_path / "p.json", "orchestrator")
    reporter.begin("waiting for the trainer's weights step 3", lane="policy", waits_for="trainer")
    later = time.monotonic() + 3600
    monkeypatch.setattr(progress.time, "monotonic", lambda: later)
    with caplog.at_level(logging.INFO, logger="prime.progress"):
        reporter._notice()
        reporter._notice()  # once per NOTICE_EVERY_S, not on every beat
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("orchestrator: still waiting for the trainer's weights step 3 after")


def test_a_full_disk_never_stops_the_process(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    reporter = ProgressReporter(blocked / "progress" / "x.json", "trainer")
    with caplog.at_level(logging.WARNING, logger="prime.progress"):
        reporter.write()
        reporter.write()
    assert len([r for r in caplog.records if "cannot write the progress file" in r.getMessage()]) == 1


def test_without_start_reporting_every_call_is_a_no_op(tmp_path):
    # A test of the same worker may have run an entry point in-process (which starts reporting): start from none.
    progress.stop_reporting()
    progress.begin("anything")
    with progress.activity("x", kind="step"):
        progress.count("n")
    assert not progress.current().enabled and not list(tmp_path.iterdir())


def test_unreadable_progress_files_read_as_none(tmp_path):
    (tmp_path / "torn.json").write_text('{"process": "trainer", "pid": ')
    (tmp_path / "other.json").write_text(json.dumps({"something": "else"}))
    assert read_progress(tmp_path / "torn.json") is None
    assert read_progress(tmp_path / "other.json") is None
    assert read_progress(tmp_path / "missing.json") is None


def test_health_answers_of_other_versions_still_parse():
    full = parse_health({"status": "ok", "engine": "torch", "weight_step": 3, "running": 2, "engine_steps": 9,
                         "decoder": "paged"})  # fmt: skip
    assert (
        full.weight_step == 3
        and full.running == 2
        and full.engine_steps == 9
        and full.model_extra["decoder"] == "paged"
    )
    partial = parse_health({"run_id": "abc"})
    assert partial.run_id == "abc" and partial.status == "ok" and partial.engine_steps is None
    odd = parse_health({"run_id": "abc", "weight_step": "three", "running": None})
    assert odd.run_id == "abc" and odd.weight_step is None and odd.running == 0
    assert parse_health(["not", "a", "dict"]).status == "ok"
