"""A process tree read from ``/proc`` (Linux): the processes of an env server, their states, commands and sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

_LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a live process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]), fields[0]


ZYGOTE_MARK = b"import zygote; zygote.main"
"""In the command line of a sandbox zygote (``sandbox.zygotes._BOOT``)."""


def process_tree(root: int) -> dict[int, str]:
    """pid -> state of ``root`` and every live descendant."""
    return {pid: state for pid, (_, state) in family(root).items()}


def family(root: int, *, without_sandboxes: bool = False) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of ``root`` and every live descendant; ``without_sandboxes`` leaves out sandbox
    zygotes and what they run: their pool watches them, and an execution that stops itself is the code's own doing."""
    parents: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(int(entry))) is not None:
            parents.setdefault(found[0], []).append(int(entry))
            stats[int(entry)] = found
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats and stats[pid][1] not in ("Z", "X"):
            if without_sandboxes and pid != root and ZYGOTE_MARK in _cmdline(pid):
                continue
            tree[pid] = stats[pid]
            todo.extend(parents.get(pid, []))
    return tree


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, it names one process, whatever reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def snapshot(root: int) -> dict[int, int | None]:
    """pid -> start time of ``root`` and every live descendant."""
    return {pid: start_time(pid) for pid in process_tree(root)}


def _still_there(pid: int, started: int | None) -> bool:
    """Whether the process of a ``snapshot`` entry still runs: the same start time, not a zombie (a child killed with
    its parent, PR_SET_PDEATHSIG, is one until whoever adopted it reaps it: dead, nothing left to end)."""
    found = _stat(pid)
    return started is not None and found is not None and found[1] not in ("Z", "X") and start_time(pid) == started


def kill_left(processes: dict[int, int | None], grace_s: float = 0.0) -> list[int]:
    """SIGKILL each process of a ``snapshot`` that is still there (and still the same process) after up to
    ``grace_s`` seconds for them to end on their own (children that die with their parent get the signal as it
    exits); the pids killed. Blocks for up to ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while any(_still_there(pid, started) for pid, started in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    killed = []
    for pid, started in processes.items():
        if _still_there(pid, started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


MARK_VAR = "PRIME_ENV_SERVER"
"""Set in an env server's environment to a token of that server. Every program it starts inherits it, so one that
left the server's tree (a daemon: ``cmd &`` in a shell that exited, a double fork; init adopted it) is still found."""


def marked(token: str) -> dict[int, int | None]:
    """pid -> start time of each live process whose environment (as it was exec'd) carries ``MARK_VAR=token``."""
    return marked_by([token])


def marked_by(tokens: list[str]) -> dict[int, int | None]:
    """``marked`` of any of ``tokens``, in one search of ``/proc``."""
    needles = [f"\0{MARK_VAR}={token}\0".encode() for token in tokens]
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone, or another user's
                continue
            if any(needle in b"\0" + environ for needle in needles):
                found[int(entry)] = start_time(int(entry))
    return found


def kill_marked(token: str) -> list[str]:
    """SIGKILL every live process carrying ``token`` (``marked``); each killed one as ``pid (command)``."""
    found = marked(token)
    commands = {pid: command(pid) for pid in found}
    return [f"{pid} ({commands[pid]})" for pid in kill_left(found)]


def command(pid: int) -> str:
    return _cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"


def listening_paths(pids: set[int]) -> dict[int, str]:
    """pid -> the unix socket path it listens on (a pool worker's ``ipc://`` address), for those that listen."""
    listening: dict[str, str] = {}
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and int(parts[3], 16) & _LISTENING:
            listening[parts[6]] = parts[7]
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in listening:
                        found[pid] = listening[link[8:-1]]
    return found
