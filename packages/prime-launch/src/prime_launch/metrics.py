"""Read ``metrics.jsonl``: follow it for the live console line, and summarize a finished run."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from prime_core.monitor import MetricsTail, iter_metrics
from prime_core.schemas.metrics import MetricsRecord


def series(records: list[MetricsRecord], process: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of one process, by step; a step logged twice keeps its last value."""
    by_step: dict[int, float] = {}
    for r in records:
        if r.process != process:
            continue
        value = r.values.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            by_step[r.step] = float(value)
    return sorted(by_step.items())


LIVE_KEYS = frozenset({"reward/mean", "loss/mean", "mismatch_kl/mean", "throughput/tokens_per_s"})
"""The metrics the live lines show: the only ones a follower keeps. It kept every name it read, and an environment's
own metric and eval names (``eval/<env>/<metric>``) are the environment's to choose: one more per new name, for the
whole run."""


class MetricsFollower:
    """Incrementally reads new lines of a metrics file and keeps the latest ``LIVE_KEYS`` values per process."""

    def __init__(self, path: Path):
        self.path = path
        self._tail = MetricsTail(path)
        self.latest: dict[str, dict[str, Any]] = defaultdict(dict)
        self.latest_step: dict[str, int] = {}

    def poll(self) -> bool:
        """Read what was appended since the last call; True if anything new arrived."""
        records = self._tail.read()
        for record in records:
            self.latest[record.process].update((k, v) for k, v in record.values.items() if k in LIVE_KEYS)
            self.latest_step[record.process] = max(record.step, self.latest_step.get(record.process, -1))
        return bool(records)

    def line(self, max_steps: int | None, elapsed_s: float) -> str:
        trainer, orch = self.latest.get("trainer", {}), self.latest.get("orchestrator", {})
        parts = []
        step = self.latest_step.get("trainer")
        if step is not None:
            parts.append(f"step {step}" + (f"/{max_steps}" if max_steps else ""))
        else:
            parts.append("step -")
        if "reward/mean" in orch:
            parts.append(f"reward {_fmt(orch['reward/mean'])} (rollout step {self.latest_step.get('orchestrator')})")
        if "loss/mean" in trainer:
            parts.append(f"loss {_fmt(trainer['loss/mean'])}")
        if "mismatch_kl/mean" in trainer:
            parts.append(f"kl {_fmt(trainer['mismatch_kl/mean'])}")
        if "throughput/tokens_per_s" in trainer:
            parts.append(f"{_fmt_rate(trainer['throughput/tokens_per_s'])} tok/s")
        parts.append(_fmt_time(elapsed_s))
        return " | ".join(parts)


def format_run_line(name: str, follower: MetricsFollower) -> str:
    """One run's part of the status line of a multi-tenant launch: its latest reward and mismatch KL."""
    orch, trainer = follower.latest.get("orchestrator", {}), follower.latest.get("trainer", {})
    parts = [name]
    if "reward/mean" in orch:
        parts.append(f"reward {_fmt(orch['reward/mean'])}")
    if "mismatch_kl/mean" in trainer:
        parts.append(f"kl {_fmt(trainer['mismatch_kl/mean'])}")
    return " ".join(parts)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_rate(value: Any) -> str:
    if not isinstance(value, int | float):
        return str(value)
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


def summarize(path: Path, num: int = 3) -> dict[str, Any]:
    """First-``num`` vs last-``num`` mean reward, max mismatch KL, last trainer step and loss. Read one record at a
    time, keeping only the values the summary needs: the whole file of a long run, parsed at once, was gigabytes
    held at the end of the run."""
    kept: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    last_trainer_step = -1
    for r in iter_metrics(path):
        if r.process == "trainer":
            last_trainer_step = max(last_trainer_step, r.step)
        for key, value in r.values.items():
            wanted = (r.process, key) in SUMMARY_KEYS or (r.process == "orchestrator" and _eval_reward(key))
            if wanted and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                kept[(r.process, key)][r.step] = float(value)
    rewards, kls = _values(kept, "orchestrator", "reward/mean"), _values(kept, "trainer", "mismatch_kl/mean")
    losses = sorted(kept.get(("trainer", "loss/mean"), {}).items())
    evals = {}
    for (_, key), by_step in sorted(kept.items()):
        if _eval_reward(key):
            points = sorted(by_step.items())
            evals[key.removeprefix("eval/").removesuffix("/reward/mean")] = (*points[0], *points[-1])
    return {
        "trainer_steps": last_trainer_step + 1,
        "rollout_steps": len(rewards),
        "reward_first": sum(rewards[:num]) / len(rewards[:num]) if rewards else None,
        "reward_last": sum(rewards[-num:]) / len(rewards[-num:]) if rewards else None,
        "mismatch_kl_max": max(kls) if kls else None,
        "loss_last": losses[-1][1] if losses else None,
        "evals": evals,
    }


SUMMARY_KEYS = frozenset({("orchestrator", "reward/mean"), ("trainer", "mismatch_kl/mean"), ("trainer", "loss/mean")})


def _eval_reward(key: str) -> bool:
    return key.startswith("eval/") and key.endswith("/reward/mean")


def _values(kept: dict[tuple[str, str], dict[int, float]], process: str, key: str) -> list[float]:
    return [v for _, v in sorted(kept.get((process, key), {}).items())]


def format_summary(summary: dict[str, Any], num: int = 3, title: str = "") -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"

    def kl(v: Any) -> str:  # a mismatch KL of 3e-9 must not print as 0.0000
        return "-" if v is None else f"{v:.3g}"

    return "\n".join(
        [
            f"summary of {title}:" if title else "summary:",
            f"  trainer steps logged     {summary['trainer_steps']}",
            f"  reward, first {num} steps  {f(summary['reward_first'])}",
            f"  reward, last {num} steps   {f(summary['reward_last'])}",
            f"  max mismatch KL          {kl(summary['mismatch_kl_max'])}",
            f"  last loss                {f(summary['loss_last'])}",
            *[
                # One eval only (a run stopped before its last): no `-> the same value at the same step`.
                f"  eval {name:<19} {f(v0)} at step {s0}" + (f" -> {f(v1)} at step {s1}" if s1 != s0 else "")
                for name, (s0, v0, s1, v1) in summary.get("evals", {}).items()
            ],
        ]
    )
