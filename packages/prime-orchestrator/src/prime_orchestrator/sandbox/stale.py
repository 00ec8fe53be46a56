"""Sweeping the cgroups of pools that are gone: a pool killed (SIGKILL, a node's crash) never removes its cgroup.

A pool names its cgroup after its owner, ``<name>.<pid>-<start>-<pidns>`` (:func:`owned_name`: the pool's pid, its
start time in clock ticks, which a reused pid does not share, and its PID namespace: a pool of another namespace is
never judged by this one's ``/proc``). At start each pool removes, beside its own, the cgroups whose
owner is provably gone (no process of that pid, or one started at another time) and which hold no process, nor any of
their children; ``rmdir`` refusing a cgroup with tasks (``EBUSY``) is the last guard. A pool being created while
another sweeps is never touched: its owner is alive from before its first ``mkdir``. A cgroup without an owner in its
name (of a pool started before owners were named) is never removed: an empty one may be a live pool's that has not
run anything yet (a sweep that took those removed a running orchestrator's pool cgroups on the test VM).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

OWNED = re.compile(r"\.(\d+)-(\d+)-(\d+)$")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot), or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owned_name(name: str) -> str:
    """``name`` tagged with this process as its owner."""
    return f"{name}.{os.getpid()}-{_start_time(os.getpid())}-{_pid_namespace()}"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _owner_gone(name: str) -> bool:
    if (m := OWNED.search(name)) is None:
        return False
    pid, start, namespace = (int(g) for g in m.groups())
    return namespace == _pid_namespace() and _start_time(pid) != start


def holds_processes(cgroup: Path) -> bool:
    """Whether any process is in ``cgroup`` or any cgroup below it."""
    for d, _, _ in os.walk(cgroup):
        try:
            if (Path(d) / "cgroup.procs").read_text().strip():
                return True
        except OSError:
            continue
    return False


def _remove(cgroup: Path) -> bool:
    """Remove an empty cgroup tree, deepest first; False when any of it stays (a process joined: EBUSY)."""
    for d, subdirs, _ in os.walk(cgroup, topdown=False):
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError):
                (Path(d) / sub).rmdir()
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return False  # another pool's sweep took it
    except OSError:
        return False
    return True


def sweep(shared: set[Path], own: set[Path]) -> int:
    """Remove the dead pools' cgroups under each ``shared`` directory, never one of ``own``; how many were removed."""
    removed = 0
    for directory in shared:
        try:
            entries = [e for e in directory.iterdir() if e.name.startswith("prime-sandbox-") and e.is_dir()]
        except OSError:
            continue
        for cgroup in entries:
            if cgroup in own or not _owner_gone(cgroup.name):
                continue
            if not holds_processes(cgroup) and _remove(cgroup):
                removed += 1
    return removed
