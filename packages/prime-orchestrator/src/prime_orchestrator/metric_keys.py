"""A bound on how many distinct metric names one environment may log (``metrics/<env>/<name>``).

An environment (or a policy it lets name things, a reward that keys its metric by the answer) can emit a new metric
name every rollout: each one became a new column of metrics.jsonl and a new W&B series, without bound. The first
``MAX_ENV_METRIC_KEYS`` names an environment logs are kept for the run; later new ones are dropped, the first of them
named once in the log, and ``metrics_dropped/<env>`` counts the names dropped from each step's metrics (each name
once per step: a name dropped at two steps counts at both; 0 at a step that dropped none, once any was).

Each ``EnvRunner`` holds its own cap (``EnvRunner.metric_keys``): one per environment of a run, training and eval
pools apart, kept over the env server's restarts. The cap itself holds at most ``limit`` names per environment: a
dropped name is counted, never stored (storing each distinct one grew without bound under such an env).
"""

from __future__ import annotations

import logging

MAX_ENV_METRIC_KEYS = 64
"""Distinct metric names (seat-prefixed ones included) one environment may log over a run."""
SHOWN = 8
"""Dropped names the one log line names."""

logger = logging.getLogger("prime.orchestrator.metrics")


class MetricKeyCap:
    """The metric names each environment logged so far (at most ``limit`` each); those past it are counted per step."""

    def __init__(self, limit: int = MAX_ENV_METRIC_KEYS):
        self.limit = limit
        self.kept: dict[str, set[str]] = {}
        self.num_dropped: dict[str, int] = {}
        """Names dropped per env over the run, counted once per step they appear at."""

    def apply(self, env: str, metrics: dict[str, float], count_key: str | None = None) -> dict[str, float]:
        """``metrics`` (name -> value) with the names past the env's limit removed, plus ``count_key`` (by default
        ``metrics_dropped/<env>``: names dropped from these metrics) once any was dropped. The first drop of an env
        is logged in one line naming some of the names dropped then."""
        kept = self.kept.setdefault(env, set())
        out: dict[str, float] = {}
        new_drops = []
        for name, value in metrics.items():
            if name not in kept and len(kept) < self.limit:
                kept.add(name)
            if name in kept:
                out[name] = value
            else:
                new_drops.append(name)
        if new_drops and env not in self.num_dropped:
            shown = sorted(new_drops)[:SHOWN]
            more = f" and {len(new_drops) - SHOWN} more" if len(new_drops) > SHOWN else ""
            logger.warning(
                "env %s logs more than %d distinct metric names; dropping the rest (%s%s); later ones are only "
                "counted in metrics_dropped/%s",
                env, self.limit, ", ".join(shown), more, env,
            )  # fmt: skip
        if new_drops or env in self.num_dropped:
            self.num_dropped[env] = self.num_dropped.get(env, 0) + len(new_drops)
            out[count_key or f"metrics_dropped/{env}"] = float(len(new_drops))
        return out
