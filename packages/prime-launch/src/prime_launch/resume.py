"""Resuming after a stop: what a stopped run left for the steps after its checkpoint goes before anything starts.

A run stopped at step k (a kill, a stuck process, a full disk) leaves rollouts and weights of steps after the checkpoint
r it resumes from. Left there, the trainer would train on the stopped run's rollouts of step r (a file that exists is
never waited for) and the orchestrator would relay its newest weights, so the resumed steps would differ from an
uninterrupted run's. ``rewind`` removes rollouts of steps >= r and weights of steps > r; the resumed processes write
them again. Newer checkpoints stay, but without their weights they are not resumable (``RunDir.resumable_steps``)
until the resumed run writes them again.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from prime_core.io import UnreadableFile, atomic_write_bytes, read_regular, remove_published
from prime_core.monitor import METRICS_BYTES  # read whole here: a file of 10 GiB was copied aside as one torn line
from prime_core.run_dir import RunDir
from prime_core.schemas.metrics import MetricsRecord
from prime_core.schemas.weights import ChangedWeights, verify_weights

_STEP = re.compile(r"^step_(\d+)$")
# What a writer builds under a temporary name before it renames it into place (``prime_core.io.atomic_dir``'s
# ``.step_N.<random>.tmp`` and ``.orchestrator.<random>.tmp``, the trainer's ``checkpoints/step_N/.trainer.tmp``).
_UNFINISHED = re.compile(r"^\.(step_\d+|trainer|orchestrator)(\.[A-Za-z0-9_]+)?\.tmp$")


def _steps(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in parent.iterdir() if (m := _STEP.match(p.name)))


def rewind(run_dir: RunDir, step: int) -> str | None:
    """Remove the rollouts of steps >= ``step``, the weights of steps > ``step`` and what a killed writer left under a
    temporary name (none of the run's processes runs now: ``rl`` holds the directory's lock); a line saying what went
    (None when nothing did)."""
    rollouts = [(s, p) for s, p in _steps(run_dir.rollouts) if s >= step]
    weights = [(s, p) for s, p in _steps(run_dir.weights) if s > step]
    for _, path in rollouts + weights:
        remove_published(path)
    parts = []
    if rollouts:
        parts.append(f"rollouts of steps {_span(rollouts)}")
    if weights:
        parts.append(f"weights of steps {_span(weights)}")
    if unfinished := _remove_unfinished(run_dir):
        parts.append(unfinished)
    moved = _set_metrics_aside(run_dir, step)
    notes = [f"removed the stopped run's {' and '.join(parts)} in {run_dir.root}"] if parts else []
    notes += [f"moved the stopped run's {moved}"] if moved else []
    if not notes:
        return None
    return f"{'; '.join(notes)} (resuming from step {step} makes them again)"


def check_resume_weights(
    steps: list[int] | tuple[int, ...], run_dirs: list[RunDir], root: Path, step: int | None = None
) -> None:
    """The weights of the step the run resumes from (``step``: ``ckpt.resume_step``; None: the newest of ``steps``, as
    ``--resume`` takes) are served again first: in every run's directory they must be what the trainer wrote
    (`verify_weights`). ValueError otherwise, one line naming the file and how to resume from the checkpoint before."""
    field = "--resume" if step is None else "ckpt.resume_step"
    step = steps[-1] if step is None and steps else step
    if step is None:
        return
    for run_dir in run_dirs:
        try:
            verify_weights(run_dir.weight_step(step), step)
        except ChangedWeights as e:
            if before := [s for s in steps if s < step]:
                again = "--resume" if field == "--resume" else f"--ckpt.resume-step {before[-1]}"
                earlier = (
                    f"`prime-launch rewind --output-dir {root} --step {before[-1]}` drops it, then {again} starts at "
                    f"checkpoint {before[-1]}"
                )
            else:
                earlier = "no earlier checkpoint to resume from (start afresh with --overwrite)"
            raise ValueError(f"{field}: checkpoint step {step} is not resumable: {e}; {earlier}") from None


def _span(found: list[tuple[int, Path]]) -> str:
    steps = [s for s, _ in found]
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _remove_unfinished(run_dir: RunDir) -> str | None:
    """Remove the temporary directories of writes a kill cut short (weights being published, rollouts being shipped,
    a checkpoint part being saved): each is as large as what it was writing, and nothing else ever removes it."""
    parents = [run_dir.rollouts, run_dir.weights, run_dir.checkpoints, *(p for _, p in _steps(run_dir.checkpoints))]
    found = sorted(p for parent in parents if parent.is_dir() for p in parent.iterdir() if _UNFINISHED.match(p.name))
    if not found:
        return None
    size = sum(f.stat().st_size for p in found for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    for path in found:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink()
    names = ", ".join(str(p.relative_to(run_dir.root)) for p in found[:3]) + (", ..." if len(found) > 3 else "")
    return f"{len(found)} unfinished writes ({size / 2**20:.1f} MiB: {names})"


STOPPED_METRICS = "metrics.stopped.jsonl"
_REDONE = ("trainer", "orchestrator")


def _set_metrics_aside(run_dir: RunDir, step: int) -> str | None:
    """Move the stopped run's trainer and orchestrator records of steps >= ``step`` (the resumed run logs them again,
    for other rollouts) and lines a kill cut short out of ``metrics.jsonl``, appended to ``metrics.stopped.jsonl``:
    every step is in ``metrics.jsonl`` once, and nothing is lost."""
    try:
        data = read_regular(run_dir.metrics, "a metrics file", METRICS_BYTES)
    except FileNotFoundError:
        return None
    except UnreadableFile as e:
        raise UnreadableFile(f"{e} (move it out of {run_dir.root} to resume without it)") from None
    keep, aside = [], []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = MetricsRecord.model_validate_json(line)
        except ValueError:
            aside.append(line)  # torn
            continue
        (aside if record.process in _REDONE and record.step >= step else keep).append(line)
    if not aside:
        return None
    with open(run_dir.root / STOPPED_METRICS, "ab") as f:
        f.write(b"".join(line + b"\n" for line in aside))
        f.flush()
        os.fsync(f.fileno())
    atomic_write_bytes(run_dir.metrics, b"".join(line + b"\n" for line in keep))
    return f"{len(aside)} metrics records of steps >= {step} to {STOPPED_METRICS}"
