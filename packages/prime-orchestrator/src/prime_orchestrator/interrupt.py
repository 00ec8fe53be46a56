"""Ctrl-C of an ``orchestrator`` started on its own: one line saying what stopped and where it stood.

asyncio.run answers the first SIGINT by cancelling the run, and every rollout's ``finally`` then clears its lane, so
by the time ``KeyboardInterrupt`` reaches the entry point the progress record no longer says what was in flight. The
record is read in the signal handler instead (`noting_sigint`), before anything is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_core import progress
from prime_core.io import is_stable
from prime_core.run_dir import RunDir
from prime_core.schemas.progress import Progress


@contextlib.contextmanager
def noting_sigint(seen: list[Progress]) -> Iterator[None]:
    """Inside the block (an event loop's, whose own SIGINT handler is installed by now) the first SIGINT appends the
    progress record to ``seen`` before the loop's handler cancels the run; later ones go straight to that handler."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored (``nohup``), or not the main thread: nothing to wrap
        yield
        return

    def on_sigint(signum, frame):
        if not seen:
            seen.append(progress.current().snapshot())
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        # asyncio.run puts the default handler back only where it still finds its own.
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def run_noting_sigint(orchestrator: Any, seen: list[Progress]) -> None:
    """``asyncio.run`` of the orchestrator's run, noting the first SIGINT in ``seen``. An error after it is that
    interrupt's doing (the terminal's Ctrl-C reaches the forkserver too: an env server starting then fails with
    ``EOFError``), so it ends as ``KeyboardInterrupt``, not as a traceback of its own."""

    async def noted() -> None:
        with noting_sigint(seen):
            await orchestrator.run()

    try:
        asyncio.run(noted())
    except Exception:
        if not seen:
            raise
        raise KeyboardInterrupt from None


def interrupted_line(record: Progress | None, shipped: list[int], output_dir: Path, interval: int | None) -> str:
    """``orchestrator: interrupted (SIGINT) ...``: the step it was on and what it was doing (``record``, taken at the
    signal), the steps it shipped to the trainer, and the newest checkpoint to resume from."""
    step = record.step if record is not None else None
    where = f"at step {step}" if step is not None else "before its first step"
    if record is not None and record.activities:
        where += f" ({'; '.join(a.what for a in record.activities)})"
    sent = f"shipped step{'s' if len(shipped) > 1 else ''} {_span(shipped)}" if shipped else "shipped no step"
    run_dir = RunDir(output_dir)
    # The orchestrator's own part is what it resumes from (the trainer's may be missing beside it, or still saving).
    parts = run_dir.checkpoints.glob("step_*/orchestrator") if run_dir.checkpoints.is_dir() else []
    steps = sorted(int(s) for p in parts if (s := p.parent.name.removeprefix("step_")).isdigit() and is_stable(p))
    if steps:
        resume = f"resume from its newest checkpoint with --ckpt.resume-step {steps[-1]}"
    else:
        resume = "it saved no checkpoint to resume from" + (" (ckpt.interval is unset)" if interval is None else "")
    return f"orchestrator: interrupted (SIGINT) {where}; {sent} to the trainer; {resume}"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def interrupted(orchestrator: Any, seen: list[Progress], output_dir: Path) -> str:
    """`interrupted_line` of a run object (the `Orchestrator`, or a test's stand-in without its attributes)."""
    config = getattr(orchestrator, "config", None)
    interval = getattr(getattr(config, "ckpt", None), "interval", None)
    return interrupted_line(seen[0] if seen else None, list(getattr(orchestrator, "shipped", [])), output_dir, interval)
