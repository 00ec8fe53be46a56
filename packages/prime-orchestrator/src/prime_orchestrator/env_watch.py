"""Hung env servers. A process of an env server that dies is seen by ``EnvServer._watch``; one that lives but does no
work is seen here, and killed, so that the server is replaced the same way and the rollouts it held re-run:

- any process of the server's tree stopped by a signal (SIGSTOP: a worker, a tool server, a harness program) is killed
  at once: it would never make progress again;
- the server itself (one worker) or each worker of its pool must answer verifiers' ``health`` request, which its event
  loop serves: a reward function or tool call that blocks the loop (never returns, sleeps synchronously) leaves it
  unanswered. A worker silent for ``probe_timeout_s`` is killed. verifiers' broker answers ``health`` itself, so the
  workers are probed directly on the ipc socket each one listens on (found through ``/proc``).

- a sandbox pool in any process of the tree (``progress/sandbox_pool_<pid>.json``, ``prime_orchestrator.sandbox``)
  that holds running executions and finished none for longer than one execution may take: the pool itself is stuck
  (its own recovery replaces zygotes that die or hang), so the process holding it is killed.

A coroutine that awaits forever is not a hang of the worker: its rollout ends at its ``rollout_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from prime_core.progress import helper_file, read_progress

logger = logging.getLogger("prime.orchestrator.env")

PROBE_INTERVAL_S = 2.0
_LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a live process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]), fields[0]


def process_tree(root: int) -> dict[int, str]:
    """pid -> state of ``root`` and every live descendant."""
    parents: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(int(entry))) is not None:
            parents.setdefault(found[0], []).append(int(entry))
            states[int(entry)] = found[1]
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in states and states[pid] not in ("Z", "X"):
            tree[pid] = states[pid]
            todo.extend(parents.get(pid, []))
    return tree


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


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


class HangWatch:
    """Probes one env server's processes; ``run`` kills what hangs, which the server's death watch then replaces."""

    def __init__(self, name: str, proc: Any, client: Any, probe_timeout_s: float, workers: Any, note: Any = None):
        self.name = name
        self.note = note
        """``note(reason)`` hears why the server is being replaced (the rollouts it held name it)."""
        self.proc = proc
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.workers = workers
        """``workers()``: live pool worker pids (empty for a single server, which ``client`` probes)."""
        self._clients: dict[int, Any] = {}
        self._last_ok: dict[int, float] = {}

    async def run(self) -> None:
        try:
            while self.proc.is_alive():
                if (reason := self.stopped() or self.stuck_pool() or await self.unanswered()) is not None:
                    logger.warning("env server %s: %s; replacing the server", self.name, reason)
                    if self.note is not None:
                        self.note(reason)
                    # The whole tree: a hung worker cleans nothing up, and its tool servers would be orphaned.
                    for pid in process_tree(self.proc.pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    return
                await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            await self.close()

    def stopped(self) -> str | None:
        """Kill every process of the tree stopped by a signal; name the first."""
        halted = [pid for pid, state in process_tree(self.proc.pid).items() if state == "T"]
        for pid in halted:
            cmd = command(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return f"pid {pid} ({cmd}) was stopped by a signal and would never resume; killed it"
        return None

    def stuck_pool(self) -> str | None:
        """Name a sandbox pool of the tree whose executions ran past their bound without one finishing."""
        now = time.time()
        for pid in process_tree(self.proc.pid):
            path = helper_file("sandbox_pool", pid)
            record = read_progress(path) if path is not None and path.exists() else None
            if record is None or record.pid != pid or record.exiting:
                continue
            for a in record.activities:
                if a.limit_s is not None and now - a.since > a.limit_s:
                    return (
                        f"the sandbox pool in pid {pid} ({command(pid)}) has been {a.what} for {now - a.since:.0f} s "
                        f"without one finishing, past its bound of {a.limit_s:.0f} s"
                    )
        return None

    async def unanswered(self) -> str | None:
        """Probe the server (or each listening worker); name one silent for ``probe_timeout_s``."""
        targets: dict[int, Any] = {}
        if self.client is not None and not self.workers():
            targets[self.proc.pid] = self.client
        else:
            from verifiers.v1.serve.client import EnvClient

            for pid, path in listening_paths(self.workers()).items():
                if pid not in self._clients:
                    self._clients[pid] = EnvClient(f"ipc://{path}")
                targets[pid] = self._clients[pid]
        now = time.monotonic()
        answers = await asyncio.gather(*(self._probe(c) for c in targets.values()))
        for pid, ok in zip(targets, answers, strict=True):
            last = self._last_ok.setdefault(pid, now)
            if ok:
                self._last_ok[pid] = now
            elif now - last > self.probe_timeout_s:
                what = "the server" if pid == self.proc.pid else "worker"
                return (
                    f"{what} pid {pid} did not answer a health probe for {now - last:.0f} s "
                    "(its event loop is blocked: a reward function or tool call that never returns?)"
                )
        return None

    async def _probe(self, client: Any) -> bool:
        try:
            return await client.health(timeout=PROBE_INTERVAL_S)
        except Exception:  # a socket of a dying worker: silence, like a timeout
            return False

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()
