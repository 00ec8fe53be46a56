"""The run-directory layout shared by every process (DESIGN.md "Run directory")."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prime_core.io import is_stable

_STEP_RE = re.compile(r"^step_(\d+)$")
# Run artifacts of a launch; anything else in the output directory is left alone.
RUN_ARTIFACTS = (
    "configs",
    "logs",
    "rollouts",
    "weights",
    "checkpoints",
    "metrics.jsonl",
    "metrics.stopped.jsonl",  # a resumed run's records of the steps it made again (prime_launch.resume)
    "samples",
    "eval",
)
DRY_RUN_MARKER = ".dry-run"
WEIGHTS_RUN_FILE = "run.json"
"""In ``weights/step_N``: the ``PRIME_RUN_ID`` of the launch whose trainer published it (null without one)."""
_RUN_CONFIG_RE = re.compile(r"^(rl|sft|trainer|inference|teacher|orchestrator(-[A-Za-z0-9_.-]+)?)\.toml$")


@dataclass(frozen=True)
class RunDir:
    """Paths inside ``--output-dir``. Creating the object touches nothing on disk."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def progress(self) -> Path:
        return self.root / "progress"

    def progress_file(self, process: str, rank: int | None = None) -> Path:
        """A process's heartbeat and activities (``prime_core.schemas.progress``); one file per trainer rank."""
        return self.progress / (f"{process}_rank_{rank}.json" if rank is not None else f"{process}.json")

    def config_file(self, process: str) -> Path:
        return self.configs / f"{process}.toml"

    def log_file(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def rollout_file(self, step: int, rank: int) -> Path:
        return self.rollout_step(step) / f"rank_{rank}.safetensors"

    def weight_step(self, step: int) -> Path:
        return self.weights / f"step_{step}"

    def checkpoint_step(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def trainer_checkpoint(self, step: int) -> Path:
        return self.checkpoint_step(step) / "trainer"

    def orchestrator_checkpoint(self, step: int) -> Path:
        return self.checkpoint_step(step) / "orchestrator"

    def stable_weight_steps(self) -> list[int]:
        """Steps under ``weights/`` whose directory carries the STABLE marker, ascending."""
        return [s for s, p in _steps(self.weights) if is_stable(p)]

    def rollout_steps(self) -> list[int]:
        """Steps with a directory under ``rollouts/``, ascending."""
        return [s for s, _ in _steps(self.rollouts)]

    def checkpoint_steps(self) -> list[int]:
        """Steps under ``checkpoints/`` with a STABLE marker, ascending."""
        return [s for s, p in _steps(self.checkpoints) if is_stable(p)]

    def resumable_steps(self, runs: Sequence[RunDir] = ()) -> list[int]:
        """Checkpoint steps a run can resume from, ascending: the trainer's part and, in every run's directory
        (``runs`` of a multi-tenant trainer, else this one), the orchestrator's part and the step's weights (served
        again on resume) are complete. A stop between the trainer's save and the orchestrator's leaves a step that is
        not resumable."""
        return [
            step
            for step in self.checkpoint_steps()
            if is_stable(self.trainer_checkpoint(step))
            and all(
                is_stable(r.orchestrator_checkpoint(step)) and is_stable(r.weight_step(step)) for r in runs or [self]
            )
        ]

    def latest_stable_weight_step(self) -> int | None:
        steps = self.stable_weight_steps()
        return steps[-1] if steps else None


def weights_run_id(weight_dir: Path) -> str | None:
    """The launch id ``weight_dir`` was published under; None when it names none (a trainer without
    ``PRIME_RUN_ID``, one older than the stamp) or the stamp does not read back (a reader then applies no check)."""
    from prime_core.io import UnreadableFile, read_json

    try:
        found = read_json(weight_dir / WEIGHTS_RUN_FILE, "a weights run stamp", 1 << 16)
    except (OSError, UnreadableFile):
        return None
    run_id = found.get("run_id") if isinstance(found, dict) else None
    return run_id if isinstance(run_id, str) else None


def foreign_artifacts(run_dir: RunDir) -> list[str]:
    """The names of run artifacts in ``run_dir`` (``logs/``, ``configs/``, ``eval/``...) when no run wrote them: no
    process config in ``configs/`` (a launch writes them first), no dry run's marker, no ``step_N`` directory, no
    metrics. A project's own ``logs/`` or ``eval/`` is never cleared as a run's."""
    root = run_dir.root
    found = [n for n in RUN_ARTIFACTS if (root / n).is_file() or ((root / n).is_dir() and any((root / n).iterdir()))]
    if not found:
        return []
    configs = run_dir.configs
    if configs.is_dir() and any(p.name == DRY_RUN_MARKER or _RUN_CONFIG_RE.match(p.name) for p in configs.iterdir()):
        return []
    return [] if has_run_outputs(run_dir) else found


def has_run_outputs(run_dir: RunDir) -> bool:
    """Whether a run has trained or sampled in ``run_dir``: a ``step_N`` directory or metrics."""
    if any(_steps(parent) for parent in (run_dir.rollouts, run_dir.weights, run_dir.checkpoints)):
        return True
    return run_dir.metrics.is_file() and run_dir.metrics.stat().st_size > 0  # a run's own directory under [[runs]]


def clear_run(run_dir: RunDir) -> None:
    """Delete the artifacts of a previous run (only the names a run writes; nothing else in the directory), and its
    ``progress/`` (heartbeats and sandbox pools' files, which the next run's watchdog would read)."""
    for name in (*RUN_ARTIFACTS, "progress"):
        path = run_dir.root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):  # a file, a link, or a FIFO left under the name (a run would wait on it)
            path.unlink()


def trainer_outputs(run_dir: RunDir) -> str | None:
    """What a trainer starting afresh in ``run_dir`` would overwrite: a previous run's complete checkpoints and the
    weights it published after step 0 (described in words), or None. With those, its rollouts are named too: the
    message says to delete what it names, and a fresh trainer takes a rollout file at its step's path without asking
    who wrote it (a stale one of step N, left after deleting only the checkpoints and weights, trained as step N).
    Rollouts alone are no sign of another run: this run's orchestrator may have started first, and a trainer may be
    fed rollouts recorded for it."""
    found = []
    if steps := [s for s in run_dir.checkpoint_steps() if is_stable(run_dir.trainer_checkpoint(s))]:
        found.append(f"checkpoints (steps {', '.join(map(str, steps))})")
    if steps := [s for s in run_dir.stable_weight_steps() if s > 0]:
        found.append(f"weights (steps {', '.join(map(str, steps))})")
    if found and (steps := run_dir.rollout_steps()):
        found.append(f"rollouts (steps {', '.join(map(str, steps))})")
    return ", ".join(found[:-1]) + " and " + found[-1] if len(found) > 1 else (found[0] if found else None)


def _steps(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    found = []
    for child in parent.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)
