"""Whether the run ``prime-launch watch`` was pointed at already ended before the watch began.

The watchdog ignores progress records written before it started (a resumed SLURM job's directory holds the stopped
job's records), so a run that had already ended looked like one whose orchestrator never started: named as stuck a
minute later. A run ended when the writer of every record watched is gone (checked by pid on this host; a record from
another host counts only where it says its process finished):

- every trainer rank wrote its final ``exiting`` record (``prime_core.progress.stop_reporting``, after its last step):
  the run finished (exit 0; an orchestrator stopped after the trainer, as a SLURM job stops it, is named);
- else a process exited without it (a crash, Ctrl-C, ``scancel``): the run ended before it finished (exit 1), also
  where another process never wrote a record (rl stopped before it started the trainer).

A record of another launch (``PRIME_RUN_ID`` set and different: the job before a resumed one), a writer still alive on
this host, or one on another host that did not say it finished leaves the run watched as a live one.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

from prime_core.progress import read_progress

from prime_launch.proc_state import gone

if TYPE_CHECKING:
    from pathlib import Path

    from prime_core.run_dir import RunDir
    from prime_core.schemas.progress import Progress


def ended(files: dict[str, list[Path]], run_id: str | None, run_dir: RunDir) -> tuple[int, str] | None:
    """Of the processes watched (name: progress files) in ``run_dir``: ``(0, line)`` for a finished run, ``(1, line)``
    for one that ended before it finished, None for a live one (or one not started yet)."""
    records: dict[str, list[Progress]] = {}
    missing = False  # a process that never wrote (stopped before it started): the run may also be starting
    for name, paths in files.items():
        for path in paths:
            if (record := read_progress(path)) is None:
                missing = True
                continue
            if run_id and record.run_id != run_id:
                return None
            local = record.host in ("", socket.gethostname())
            if (local and not gone(record)) or (not local and not record.exiting):
                return None  # a writer alive here (a frozen one is the watchdog's to name), or one elsewhere
            records.setdefault(name, []).append(record)
    found = [r for rs in records.values() for r in rs]
    decisive = records.get("trainer") or found
    where = f"the run in {run_dir.root}"
    if found and not missing and all(r.exiting for r in decisive):
        latest = run_dir.latest_stable_weight_step()
        weights = f"; final weights {run_dir.weight_step(latest)}" if latest is not None else ""
        stopped = "".join(f"; {_stopped(r)} after the trainer finished" for r in found if not r.exiting)
        return 0, f"{where} has finished: {_names(decisive)} exited after its work{weights}{stopped}; nothing to watch"
    if failed := [r for r in decisive if not r.exiting] or [r for r in found if not r.exiting]:
        log = run_dir.log_file(failed[0].process)
        return 1, f"{where} ended before it finished: {_stopped(failed[0])} (log: {log})"
    return None


def _stopped(record: Progress) -> str:
    if record.activities:
        where = f", while {record.doing()}"
    else:
        where = f" at step {record.step}" if record.step is not None else ""
    return f"{record.name} (pid {record.pid}) exited without finishing{where}"


def _names(records: list[Progress]) -> str:
    names = list(dict.fromkeys(r.process for r in records))
    return " and ".join(names)


def running(run_dir: RunDir, within_s: float = 60.0) -> list[str]:
    """Processes of the run in ``run_dir`` still running on this host (``trainer rank 0 (pid 123)``): a heartbeat of
    the last ``within_s`` from a live pid that has not said it finished (another host's cannot be told). An inference
    server is not one: it writes nothing a rewind removes, and a server kept up between two launches (vLLM loads for
    minutes) serves the resumed run."""
    found = []
    for path in sorted(run_dir.progress.glob("*.json")) if run_dir.progress.is_dir() else []:
        record = read_progress(path)
        if record is None or record.exiting or record.process == "inference":
            continue
        if record.host not in ("", socket.gethostname()):
            continue
        if time.time() - record.time < within_s and not gone(record):
            found.append(f"{record.name} (pid {record.pid})")
    return found
