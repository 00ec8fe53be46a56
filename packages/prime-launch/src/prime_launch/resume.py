"""Resuming after a stop: what a stopped run left for the steps after its checkpoint goes before anything starts.

A run stopped at step k (a kill, a stuck process, a full disk) leaves rollouts and weights of steps after the checkpoint
r it resumes from. Left there, the trainer would train on the stopped run's rollouts of step r (a file that exists is
never waited for) and the orchestrator would relay its newest weights, so the resumed steps would differ from an
uninterrupted run's. ``rewind`` removes rollouts of steps >= r and weights of steps > r; the resumed processes write
them again. Newer checkpoints stay, but without their weights they are not resumable (``RunDir.resumable_steps``)
until the resumed run writes them again.
"""

from __future__ import annotations

import re
from pathlib import Path

from prime_core.io import remove_published
from prime_core.run_dir import RunDir

_STEP = re.compile(r"^step_(\d+)$")


def _steps(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in parent.iterdir() if (m := _STEP.match(p.name)))


def rewind(run_dir: RunDir, step: int) -> str | None:
    """Remove the rollouts of steps >= ``step`` and the weights of steps > ``step``; a line saying what went (None when
    nothing did)."""
    rollouts = [(s, p) for s, p in _steps(run_dir.rollouts) if s >= step]
    weights = [(s, p) for s, p in _steps(run_dir.weights) if s > step]
    for _, path in rollouts + weights:
        remove_published(path)
    parts = []
    if rollouts:
        parts.append(f"rollouts of steps {_span(rollouts)}")
    if weights:
        parts.append(f"weights of steps {_span(weights)}")
    if not parts:
        return None
    return f"removed the stopped run's {' and '.join(parts)} in {run_dir.root} (resuming from step {step} makes them again)"


def _span(found: list[tuple[int, Path]]) -> str:
    steps = [s for s, _ in found]
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
