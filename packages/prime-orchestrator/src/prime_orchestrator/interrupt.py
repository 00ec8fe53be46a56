"""Ctrl-C of an ``orchestrator`` started on its own: one line saying what stopped and where it stood.

asyncio.run answers the first SIGINT by cancelling the run, and every rollout's ``finally`` then clears its lane, so
by the time ``KeyboardInterrupt`` reaches the entry point the progress record no longer says what was in flight. The
record is read in the signal handler instead (`noting_sigint`), before anything is cancelled.

A second Ctrl-C, at any point after the first (the run's close stopping env servers or waiting for a thread, the
exit's joins), ends the process at once, as ``inference`` does: the env servers' leftovers killed (their cgroups and
tokens: what their stop would have looked for), the line (unless printed already), the progress record's last entry,
exit 130. Before, it raised ``KeyboardInterrupt`` wherever the close stood: the close waited for
threads still running anyway (a thread blocked for 20 s held the exit 20 s), and one landing in the exit's joins or
the line's own printing ended in a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_core import progress
from prime_core.io import is_stable
from prime_core.run_dir import RunDir
from prime_core.schemas.progress import Progress

from prime_orchestrator.batch import ShippedSteps
from prime_orchestrator.server_cgroup import kill_open  # not in the signal handler: an import there can deadlock


class Interrupts:
    """A run's Ctrl-Cs: the progress record at the first (``seen``), and its one line, printed once (``say``)."""

    def __init__(self, orchestrator: Any, output_dir: Path):
        self.orchestrator, self.output_dir = orchestrator, output_dir
        self.seen: list[Progress] = []
        self.said = False

    def say(self) -> None:
        if not self.said:
            self.said = True  # first: a second Ctrl-C while it prints must not print it again
            print(interrupted(self.orchestrator, self.seen, self.output_dir), file=sys.stderr, flush=True)

    def end_now(self, signum: int = signal.SIGINT, frame: Any = None) -> None:
        """A second Ctrl-C: the line, the progress record's last entry, exit 130, without the rest of the close; but
        first what the env servers not yet stopped left (daemons in their cgroups, programs with their token), which
        only their stop looked for, is killed (``server_cgroup.kill_open``, within 0.5 s), a third Ctrl-C ignored."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            kill_open()
        self.say()
        with contextlib.suppress(Exception):
            progress.stop_reporting()
        os._exit(130)


@contextlib.contextmanager
def noting_sigint(notes: Interrupts) -> Iterator[None]:
    """Inside the block (an event loop's, whose own SIGINT handler is installed by now) the first SIGINT appends the
    progress record to ``notes.seen`` before the loop's handler cancels the run; a later one, in the block or after
    it, ends the process (``Interrupts.end_now``)."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored (``nohup``), or not the main thread: nothing to wrap
        yield
        return

    def on_sigint(signum, frame):
        if notes.seen:
            notes.end_now()
        notes.seen.append(progress.current().snapshot())
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        # asyncio.run puts the default handler back only where it still finds its own.
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, notes.end_now if notes.seen else signal.default_int_handler)


def run_noting_sigint(orchestrator: Any, notes: Interrupts) -> None:
    """``asyncio.run`` of the orchestrator's run, noting the first SIGINT in ``notes``. An error after it is that
    interrupt's doing (the terminal's Ctrl-C reaches the forkserver too: an env server starting then fails with
    ``EOFError``), so it ends as ``KeyboardInterrupt``, not as a traceback of its own."""

    async def noted() -> None:
        with noting_sigint(notes):
            await orchestrator.run()

    try:
        asyncio.run(noted())
    except Exception:
        if not notes.seen:
            raise
        raise KeyboardInterrupt from None


def interrupted_line(record: Progress | None, shipped: ShippedSteps, output_dir: Path, interval: int | None) -> str:
    """``orchestrator: interrupted (SIGINT) ...``: the step it was on and what it was doing (``record``, taken at the
    signal), the steps it shipped to the trainer, and the newest checkpoint to resume from."""
    step = record.step if record is not None else None
    where = f"at step {step}" if step is not None else "before its first step"
    if record is not None and record.activities:
        where += f" ({'; '.join(a.what for a in record.activities)})"
    span = f"steps {shipped.first}-{shipped.last}" if shipped.count > 1 else f"step {shipped.last}"
    sent = f"shipped {span}" if shipped.count else "shipped no step"
    run_dir = RunDir(output_dir)
    # The orchestrator's own part is what it resumes from (the trainer's may be missing beside it, or still saving).
    parts = run_dir.checkpoints.glob("step_*/orchestrator") if run_dir.checkpoints.is_dir() else []
    steps = sorted(int(s) for p in parts if (s := p.parent.name.removeprefix("step_")).isdigit() and is_stable(p))
    if steps:
        resume = f"resume from its newest checkpoint with --ckpt.resume-step {steps[-1]}"
    else:
        resume = "it saved no checkpoint to resume from" + (" (ckpt.interval is unset)" if interval is None else "")
    return f"orchestrator: interrupted (SIGINT) {where}; {sent} to the trainer; {resume}"


def interrupted(orchestrator: Any, seen: list[Progress], output_dir: Path) -> str:
    """`interrupted_line` of a run object (the `Orchestrator`, or a test's stand-in without its attributes)."""
    config = getattr(orchestrator, "config", None)
    interval = getattr(getattr(config, "ckpt", None), "interval", None)
    shipped = getattr(orchestrator, "shipped", ShippedSteps())
    return interrupted_line(seen[0] if seen else None, shipped, output_dir, interval)
