"""Two processes of a run that wait only on each other: a hand-off between them was lost.

The trainer waits for the orchestrator's rollouts of step N; the orchestrator, having shipped them, waits for the
trainer's weights of step N + 1. Each wait has no bound of its own in the watchdog (the process waited for is watched,
and it is alive), so when the rollouts file is gone before the trainer read it (deleted by hand or by a cleanup job,
or not visible on a shared file system) both sat there: the orchestrator's `weights_timeout` (1200 s) ended the run
with `is the trainer running?`, the trainer's `data.wait_timeout_s` (3600 s) with its own line. ``wait_cycle`` finds
the pair once both have waited on each other, and on nothing else, for more than ``slack_s``.
"""

from __future__ import annotations

from collections.abc import Callable

from prime_core.schemas.progress import Activity, Progress


def _waits_only_on(record: Progress) -> str | None:
    """The one process every activity of ``record`` waits for; None when it does anything else."""
    targets = {a.waits_for for a in record.activities}
    if record.exiting or not record.activities or len(targets) != 1 or None in targets:
        return None
    return targets.pop()


def wait_cycle(
    records: dict[str, list[Progress]], lasted: Callable[[Progress, Activity], float], slack_s: float
) -> tuple[str, str] | None:
    """``records``: each watched process's fresh records (a trainer: one per rank). Returns (the process to blame, the
    line) when two processes have waited only on each other for more than ``slack_s``; the one that has waited longer
    is blamed: it missed what the other handed it."""
    waiting = [(name, r, _waits_only_on(r)) for name, rs in records.items() for r in rs]
    for name, record, target in waiting:
        for other_name, other, back in waiting:
            if target != other_name or back != name:
                continue
            mine = min(lasted(record, a) for a in record.activities)
            theirs = min(lasted(other, a) for a in other.activities)
            if min(mine, theirs) <= slack_s or mine < theirs:
                continue
            line = (
                f"{record.name} has been {record.doing()} for {mine:.0f} s while {other.name} has been "
                f"{other.doing()} for {theirs:.0f} s: each waits on the other, so what one handed the other was lost "
                "(a file deleted or not visible on this file system, or a message dropped)"
            )
            return name, line
    return None
