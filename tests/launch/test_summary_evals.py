"""What ``rl`` prints at the end of a run: each eval (per environment and temperature) before and after, next to the
training reward, read from the run's metrics.jsonl."""

from __future__ import annotations

import json

from prime_launch.metrics import format_summary, summarize


def _write(path, records) -> None:
    path.write_text("".join(json.dumps({"process": p, "step": s, "values": v}) + "\n" for p, s, v in records))


def test_summary_prints_every_eval_before_and_after(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [
        ("orchestrator", 0, {"eval/reverse-text/t1/reward/mean": 0.303, "eval/reverse-text/t0/reward/mean": 0.5972})
    ]
    records += [("orchestrator", s, {"reward/mean": 0.3 + 0.004 * s}) for s in range(60)]
    records += [("trainer", s, {"loss/mean": 0.01, "mismatch_kl/mean": 3e-9}) for s in range(60)]
    # A checkpoint-interval eval in between does not hide the first or the last.
    records += [("orchestrator", 30, {"eval/reverse-text/t1/reward/mean": 0.45})]
    records += [
        ("orchestrator", 60, {"eval/reverse-text/t1/reward/mean": 0.5364, "eval/reverse-text/t0/reward/mean": 0.6172})
    ]
    _write(metrics, records)
    summary = summarize(metrics)
    assert summary["evals"] == {"reverse-text/t0": (0, 0.5972, 60, 0.6172), "reverse-text/t1": (0, 0.303, 60, 0.5364)}
    text = format_summary(summary)
    assert "eval reverse-text/t0     0.5972 at step 0 -> 0.6172 at step 60" in text
    assert "eval reverse-text/t1     0.3030 at step 0 -> 0.5364 at step 60" in text
    assert "reward, first 3 steps  0.3040" in text and "trainer steps logged     60" in text


def test_a_run_without_evals_prints_no_eval_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [("orchestrator", 0, {"reward/mean": 0.5}), ("trainer", 0, {"loss/mean": 0.1})])
    summary = summarize(metrics)
    assert summary["evals"] == {}
    assert "eval " not in format_summary(summary)


def test_a_run_stopped_after_its_first_eval_prints_it_once(tmp_path):
    """A run stopped (Ctrl-C) after the eval before its first step printed `0.5253 at step 0 -> 0.5253 at step 0`."""
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [("orchestrator", 0, {"eval/reverse-text/t0/reward/mean": 0.5253, "reward/mean": 0.2})])
    text = format_summary(summarize(metrics))
    assert text.splitlines()[-1] == "  eval reverse-text/t0     0.5253 at step 0"
