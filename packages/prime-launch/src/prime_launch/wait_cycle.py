"""Two processes of a run that wait only on each other: a hand-off between them was lost.

The trainer waits for the orchestrator's rollouts of step N; the orchestrator, having shipped them, waits for the
trainer's weights of step N + 1. Each wait has no bound of its own in the watchdog (the process waited for is watched,
and it is alive), so when the rollouts file is gone before the trainer read it (deleted by hand or by a cleanup job,
or not visible on a shared file system) both sat there: the orchestrator's `weights_timeout` (1200 s) ended the run
with `is the trainer running?`, the trainer's `data.wait_timeout_s` (3600 s) with its own line.

``WaitCycles`` names the pair once the watchdog has seen them wait on each other, and on nothing else, for more than
``slack_s`` in a row. Seen, not reported: each activity's own duration counts from when it began, and the orchestrator
starts waiting for the next weights while it still generates and ships (other lanes), and a record is up to a
heartbeat old, so the two durations overlapped for seconds where a run was healthy (`benchmarks/chaos.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from prime_core.schemas.progress import Progress


def _waits_only_on(record: Progress) -> str | None:
    """The one process every activity of ``record`` waits for; None when it does anything else."""
    targets = {a.waits_for for a in record.activities}
    if record.exiting or not record.activities or len(targets) != 1 or None in targets:
        return None
    return targets.pop()


class WaitCycles:
    """Pairs of processes seen waiting only on each other, and since when (on the watchdog's clock)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.since: dict[tuple[str, ...], float] = {}

    def check(self, records: dict[str, list[Progress]], slack_s: float) -> tuple[str, str] | None:
        """``records``: each watched process's fresh records (a trainer: one per rank). Returns (the process to blame,
        the line) for a pair seen waiting only on each other for more than ``slack_s``. The one at the lower step is
        blamed (the trainer waiting for rollouts of step N, not the orchestrator waiting for the weights N + 1 that
        training them makes): the earliest thing missing is what it waits for."""
        now, seen, found = self.clock(), {}, None
        waiting = [(name, r, _waits_only_on(r)) for name, rs in records.items() for r in rs]
        for name, record, target in waiting:
            for other_name, other, back in waiting:
                if target != other_name or back != name or _upstream(other, record):
                    continue
                key = (record.name, record.doing(), other.name, other.doing())
                seen[key] = self.since.get(key, now)
                if found is None and now - seen[key] > slack_s:
                    found = (
                        name,
                        (
                            f"{record.name} has been {record.doing()} while {other.name} has been {other.doing()}: each "
                            f"has waited only on the other for {now - seen[key]:.0f} s, so what one handed the other was "
                            "lost (a file deleted or not visible on this file system, or a message dropped)"
                        ),
                    )
        self.since = seen
        return found


def _upstream(a: Progress, b: Progress) -> bool:
    """Whether ``a`` is at an earlier step than ``b`` (ties: the name first in order)."""
    return (a.step if a.step is not None else -1, a.name) < (b.step if b.step is not None else -1, b.name)
