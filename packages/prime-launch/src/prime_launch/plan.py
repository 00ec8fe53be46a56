"""The names and the run directory of a launch: process names, what a run leaves in its output directory, the
check that it holds no other run, and the copy-pasteable command line of a process. What each process runs is
worked out by ``prime_launch.resolver``."""

from __future__ import annotations

import io
import os
import shlex

from prime_core.io import open_regular
from prime_core.run_dir import DRY_RUN_MARKER, RUN_ARTIFACTS, RunDir, foreign_artifacts

from prime_launch.cpu_threads import THREAD_ENV_VARS
from prime_launch.process import ProcessSpec


def orchestrator_name(run: str) -> str:
    """The orchestrator process of a run under ``[[runs]]``."""
    return f"orchestrator-{run}"


def role(process: str) -> str:
    """The entry point of a process (``orchestrator-<run>`` runs ``orchestrator``)."""
    return "orchestrator" if process.startswith("orchestrator") else process


def existing_artifacts(run_dir: RunDir) -> list[str]:
    """Artifacts of another run in ``run_dir`` (a dry run's configs do not count)."""
    found = []
    for name in RUN_ARTIFACTS:
        path = run_dir.root / name
        if name == "configs" and (path / DRY_RUN_MARKER).exists():
            continue
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def trained(run_dir: RunDir) -> bool:
    """Whether the run in ``run_dir`` got through a step: a checkpoint, weights after step 0, a metrics record
    (trainer or orchestrator), samples or evals. A start that failed before that left only disposable artifacts
    (configs, logs, partial step-0 rollouts)."""
    root = run_dir.root
    if any(p.is_dir() and any(p.iterdir()) for p in (run_dir.checkpoints, root / "samples", root / "eval")):
        return True
    if run_dir.weights.is_dir() and any(p.name != "step_0" for p in run_dir.weights.iterdir()):
        return True
    try:
        with io.TextIOWrapper(open_regular(run_dir.metrics), encoding="utf-8", errors="replace") as f:
            return any(line.strip() for line in f)
    except OSError:
        return False


def check_output_dir(run_dir: RunDir, *, overwrite: bool, resume: bool, resumable: bool = True) -> None:
    """Refuse an output directory holding another run that trained, unless resuming or overwriting, and one whose
    ``logs/``, ``configs/``... no run wrote (a start clears a failed start's, and ``--overwrite`` a run's). The refusal
    offers ``--resume`` only where the run has a checkpoint to resume from (``resumable``)."""
    for metrics in (run_dir.metrics, run_dir.root / "metrics.stopped.jsonl"):
        if not overwrite and os.path.lexists(metrics) and not metrics.is_file():
            # A FIFO there: the launcher's own read, and the appends (the processes', --resume's), wait in open for ever.
            raise FileExistsError(
                f"{metrics} is not a regular file (the run appends its metrics to one): remove it, or pass --overwrite"
            )
    if not resume and (foreign := foreign_artifacts(run_dir)):
        raise FileExistsError(
            f"output directory {run_dir.root} holds {', '.join(foreign)} that no run wrote (no configs/<process>.toml, "
            "no step_N directories, no metrics), which starting a run there would delete; choose another --output-dir"
        )
    found = existing_artifacts(run_dir)
    if found and not (overwrite or resume) and trained(run_dir):
        # Before, --resume was offered for a run that kept no checkpoint, and --resume then refused it.
        resume_it = "pass --resume to continue it, " if resumable else "it has no checkpoint to resume from; pass "
        raise FileExistsError(
            f"output directory {run_dir.root} holds another run ({', '.join(found)}); {resume_it}--overwrite to "
            "delete it and start afresh, or choose another --output-dir"
        )


def command_line(spec: ProcessSpec) -> str:
    """A copy-pasteable shell line for a process (devices and run id included)."""
    shown = {k: v for k, v in spec.env.items() if k in ("CUDA_VISIBLE_DEVICES", "PRIME_RUN_ID", *THREAD_ENV_VARS)}
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
    cmd = " ".join(shlex.quote(c) for c in spec.cmd)
    return f"{prefix} {cmd} > {shlex.quote(str(spec.log_file))} 2>&1" if prefix else cmd
