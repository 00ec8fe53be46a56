"""Each env server in a cgroup v2 of its own, so that every program it starts is found at its stop.

The token each env server puts in its environment (``proc_tree.MARK_VAR``) finds the programs that left its tree (a
daemon: ``cmd &`` in a shell that exited, a double fork), but not one started with a cleared environment
(``env -i sleep 999 &``, ``subprocess.Popen(..., env={})``). A cgroup holds every process forked inside it, whatever
it did with its environment, session or parent. Where the host lets this process create a child of its own v2 cgroup
(root, or a delegated cgroup), the orchestrator makes ``prime-env-<token>`` below it for each server, the server
joins it first thing (``join``), and at the server's stop every process still in it is killed (``kill_members``,
``cgroup.kill``) and the cgroup removed. Elsewhere (no writable cgroup v2) the token search is what remains, said in
one line. It costs a ``mkdir`` in the orchestrator (0.1 ms) and a write in the server (0.4 ms; 10 ms the first).

An exit that skips the servers' stop (a second Ctrl-C: ``interrupt.Interrupts.end_now``) still kills what each server
not yet stopped holds, by its cgroup and its token (``kill_open``), within half a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from prime_orchestrator.proc_tree import command, kill_left, marked_by
from prime_orchestrator.sandbox.hierarchies import ENV_SERVER_CGROUP, mounts, own_cgroups, path_of

logger = logging.getLogger("prime.orchestrator.env")


def create(token: str) -> tuple[Path | None, str]:
    """A new v2 cgroup ``prime-env-<token>`` below this process's own, or None and why there is none."""
    try:
        parent = path_of("", mounts(), own_cgroups())
    except OSError as e:
        return None, f"cannot read this process's cgroups ({e.strerror})"
    if parent is None:
        return None, "no cgroup v2 mount"
    path = parent / f"{ENV_SERVER_CGROUP}{token}"
    try:
        path.mkdir()
    except OSError as e:
        return None, f"cannot create {path} ({e.strerror})"
    return path, ""


def join(path: str | Path) -> None:
    """Move the calling process into ``path`` (the env server, before it starts anything)."""
    Path(path, "cgroup.procs").write_text("0")


def members(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_members(path: Path, wait_s: float = 1.0) -> list[str]:
    """SIGKILL every process still in ``path`` (each as ``pid (command)``), then remove it. Waits up to ``wait_s`` for
    the kernel to empty it (an empty cgroup is removed at once)."""
    found = {pid: command(pid) for pid in members(path)}
    if found:
        _kill(path, found)
    _remove(path, time.monotonic() + wait_s)
    return [f"{pid} ({cmd})" for pid, cmd in found.items()]


def _kill(path: Path, pids: Iterable[int]) -> None:
    try:
        (path / "cgroup.kill").write_text("1")  # every member, and what they fork meanwhile (Linux 5.14)
    except OSError:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _remove(path: Path, deadline: float) -> None:
    """Remove ``path`` once the kernel emptied it (an empty cgroup is removed at once), until ``deadline``."""
    while True:
        try:
            path.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:  # still populated: the killed ones are being torn down
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)


_said: list[str] = []

_open: dict[str, Path | None] = {}
"""token -> cgroup (None where there is none) of each env server started and not yet stopped (``forget``): what
``kill_open`` ends at a fast exit. Entries live as long as their servers; a restart replaces one."""


def forget(token: str) -> None:
    """The server of ``token`` stopped: its cgroup and token were searched (``EnvServer._stop``)."""
    _open.pop(token, None)


def kill_open(wait_s: float = 0.5) -> None:
    """At an exit that skips the env servers' stop (a second Ctrl-C, in its signal handler: nothing logged): SIGKILL
    every process of every server not yet stopped, in its cgroup (``cgroup.kill``, what they fork meanwhile too) and by
    its token (searched again until a search finds none: a daemon that forks again), then remove the cgroups, all
    within about ``wait_s`` (the cost: one ``/proc`` search per round, ~1 ms per 100 processes)."""
    deadline = time.monotonic() + wait_s
    servers = list(_open.items())
    for _, path in servers:
        if path is not None:
            _kill(path, members(path))
    tokens = [token for token, _ in servers]
    while tokens and (found := marked_by(tokens)) and kill_left(found) and time.monotonic() < deadline:
        pass
    for _, path in servers:
        if path is not None:
            _remove(path, deadline)


def own_cgroup(token: str) -> str | None:
    """``create``'s cgroup for an env server (as a string, for the server's arguments); where there is none, the first
    time says why in one line."""
    path, why = create(token)
    _open[token] = path
    if path is None and not _said:
        _said.append(why)
        logger.warning("env servers run without cgroups of their own (%s): a program one starts with a cleared "
                       "environment (env -i) that outlives it is not found at its stop", why)  # fmt: skip
    return str(path) if path is not None else None
