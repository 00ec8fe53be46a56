"""What the watchdog says of a local process: its state (stopped by a signal, a zombie...) from ``/proc``, and
the pid notes of its lines."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from prime_core.schemas.progress import Progress

STATES = {
    "T": "stopped by a signal",
    "t": "stopped by a debugger",
    "D": "in uninterruptible I/O",
    "Z": "a zombie",
    "R": "running",
    "S": "sleeping",
}


def process_state(pid: int, host: str = "") -> str | None:
    """``stopped by a signal``, ``running``, ... of a local process (None for another host or a missing pid)."""
    if host and host != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    code = stat[stat.rfind(")") + 2 :].split(" ", 1)[0]
    return STATES.get(code, f"state {code}")


def gone(record: Progress) -> bool:
    """Whether the writer of ``record`` was on this host and has exited (no such pid, or a zombie)."""
    if record.host and record.host != socket.gethostname():
        return False
    return process_state(record.pid) in (None, STATES["Z"])


def stopped_note(root: int | None) -> str:
    """`` (pid N stopped by a signal)`` when ``root`` or a process under it (a trainer's rank) is stopped: a process
    that never wrote its first heartbeat says no pid of its own."""
    seen, todo = set(), [root] if root is not None else []
    while todo and len(seen) < 4096:
        pid = todo.pop()
        seen.add(pid)
        if (state := process_state(pid)) in (STATES["T"], STATES["t"]):
            return f" (pid {pid} {state})"
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(c) for c in (task / "children").read_text().split() if int(c) not in seen)
    return ""


def pid_note(pid: int | None, host: str = "") -> str:
    if pid is None:
        return ""
    state = process_state(pid, host)
    return (
        f"pid {pid}"
        + (f", {state}" if state else "")
        + (f" on {host}" if host and host != socket.gethostname() else "")
    )
