"""A bound on how many distinct metric names one environment may log (``metrics/<env>/<name>``).

An environment (or a policy it lets name things, a reward that keys its metric by the answer) can emit a new metric
name every rollout: each one became a new column of metrics.jsonl and a new W&B series, without bound. The first
``MAX_ENV_METRIC_KEYS`` names an environment logs are kept for the run; later new ones are dropped, named once in
the log, and counted in ``metrics_dropped/<env>`` (distinct names dropped so far).
"""

from __future__ import annotations

import logging

MAX_ENV_METRIC_KEYS = 64
"""Distinct metric names (seat-prefixed ones included) one environment may log over a run."""

logger = logging.getLogger("prime.orchestrator.metrics")


class MetricKeyCap:
    """The metric names each environment logged so far, and those dropped past ``limit``."""

    def __init__(self, limit: int = MAX_ENV_METRIC_KEYS):
        self.limit = limit
        self.kept: dict[str, set[str]] = {}
        self.dropped: dict[str, set[str]] = {}

    def apply(self, env: str, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` (name -> value) with the names past the env's limit removed, plus ``metrics_dropped/<env>``
        once any was dropped. The first drop of an env is logged in one line naming the names dropped then."""
        kept = self.kept.setdefault(env, set())
        dropped = self.dropped.setdefault(env, set())
        out: dict[str, float] = {}
        new_drops = []
        for name, value in metrics.items():
            if name not in kept and len(kept) < self.limit:
                kept.add(name)
            if name in kept:
                out[name] = value
            elif name not in dropped:
                new_drops.append(name)
        if new_drops and not dropped:
            shown = ", ".join(sorted(new_drops)[:8]) + (f" and {len(new_drops) - 8} more" if len(new_drops) > 8 else "")
            logger.warning(
                "env %s logs more than %d distinct metric names; dropping the rest (%s); later ones are only "
                "counted in metrics_dropped/%s",
                env, self.limit, shown, env,
            )  # fmt: skip
        dropped.update(new_drops)
        if dropped:
            out[f"metrics_dropped/{env}"] = float(len(dropped))
        return out


ENV_METRIC_KEYS = MetricKeyCap()
"""The run's cap (one orchestrator per process)."""
