"""Hung env servers. A process of an env server that dies is seen by ``EnvServer._watch``; one that lives but does no
work is seen here, and killed, so that the server is replaced the same way and the rollouts it held re-run:

- any process of the server's tree stopped by a signal (SIGSTOP: a worker, a tool server, a harness program) is killed
  at once: it would never make progress again. Sandbox zygotes and their executions are left to their pool (which
  replaces a zygote that hangs and kills an execution at its wall limit): code that stops itself must not take the
  env server down;
- the server itself (one worker) or each worker of its pool must answer verifiers' ``health`` request, which its event
  loop serves: a reward function or tool call that blocks the loop (never returns, sleeps synchronously) leaves it
  unanswered. A worker silent for ``probe_timeout_s`` is killed, its reason naming the function its loop is stuck in
  (``prime_orchestrator.stacks``). verifiers' broker answers ``health`` itself, so the workers are probed directly on
  the ipc socket each one listens on (found through ``/proc``);
- a shared tool server of a worker (``tool_watch``) that exits while its worker lives, or does not answer HTTP for
  ``probe_timeout_s``: verifiers never starts another, so the server is replaced;
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
from typing import Any

from prime_core.progress import helper_file, lasted, read_progress

from prime_orchestrator.proc_tree import command, family, listening_paths, process_tree
from prime_orchestrator.stacks import blocked_in
from prime_orchestrator.tool_watch import ToolWatch

__all__ = ["HangWatch", "command", "listening_paths", "process_tree"]

logger = logging.getLogger("prime.orchestrator.env")

PROBE_INTERVAL_S = 2.0


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
        self._clients: dict[int, tuple[str, Any]] = {}
        """pid -> (the ipc path it listens on, a client of it) of each worker probed; a worker that left the pool is
        dropped at the next probe, and a pid listening on another path is another worker (the pid reused)."""
        self._last_ok: dict[int, float] = {}
        self._probes: dict[int, asyncio.Task] = {}
        """One health request in flight per process, waiting up to ``probe_timeout_s`` for its answer."""
        self.tools = ToolWatch(probe_timeout_s, PROBE_INTERVAL_S)

    async def run(self) -> None:
        try:
            while self.proc.is_alive():
                if (reason := await self.fault()) is not None:
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

    async def fault(self) -> str | None:
        """Why the server must be replaced now, or None."""
        tree = family(self.proc.pid, without_sandboxes=True)
        states = {pid: state for pid, (_, state) in tree.items()}
        if reason := self.stopped(states) or self.tools.gone(tree) or self.stuck_pool(states):
            return reason
        worker, tool = await asyncio.gather(self.unanswered(), self.tools.silent())
        return worker or tool

    def stopped(self, tree: dict[int, str] | None = None) -> str | None:
        """Kill every process of the tree stopped by a signal; name the first."""
        tree = process_tree(self.proc.pid) if tree is None else tree
        halted = [pid for pid, state in tree.items() if state == "T"]
        for pid in halted:
            cmd = command(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return f"pid {pid} ({cmd}) was stopped by a signal and would never resume; killed it"
        return None

    def stuck_pool(self, tree: Any = None) -> str | None:
        """Name a sandbox pool of the tree whose executions ran past their bound without one finishing."""
        for pid in process_tree(self.proc.pid) if tree is None else tree:
            path = helper_file("sandbox_pool", pid)
            record = read_progress(path) if path is not None and path.exists() else None
            # A file an earlier run left in progress/ under a pid now reused (a resume keeps progress/) is not this
            # pool's: the run's own carry its id.
            own = os.environ.get("PRIME_RUN_ID")
            if record is None or record.pid != pid or record.exiting or (own is not None and record.run_id != own):
                continue
            for a in record.activities:
                if a.limit_s is not None and (took := lasted(record, a)) > a.limit_s:
                    return (
                        f"the sandbox pool in pid {pid} ({command(pid)}) has been {a.what} for {took:.0f} s "
                        f"without one finishing, past its bound of {a.limit_s:.0f} s"
                    )
        return None

    async def unanswered(self) -> str | None:
        """Probe the server (or each listening worker); name one silent for ``probe_timeout_s``."""
        targets: dict[int, Any] = {}
        if self.client is not None and not self.workers():
            targets[self.proc.pid] = self.client
        else:
            for pid, path in listening_paths(self.workers()).items():
                if self._clients.get(pid, (path,))[0] != path:
                    await self._forget(pid)  # the pid of a worker that left, now another's: it inherits nothing
                if pid not in self._clients:
                    self._clients[pid] = (path, worker_client(path))
                targets[pid] = self._clients[pid][1]
        for pid in (self._probes.keys() | self._last_ok.keys() | self._clients.keys()) - targets.keys():
            await self._forget(pid)  # a worker that left the pool: over days of restarts these added up
        now = time.monotonic()
        for pid, client in targets.items():
            self._last_ok.setdefault(pid, now)
            if pid not in self._probes or self._probes[pid].done():
                self._probes[pid] = asyncio.create_task(self._probe(pid, client))
        await asyncio.sleep(0)  # an answer already waiting lands before the verdict
        for pid in targets:
            if now - (last := self._last_ok[pid]) > self.probe_timeout_s:
                what = "the server" if pid == self.proc.pid else "worker"
                where = await blocked_in(pid)
                why = f" in {where}" if where else ": a reward function or tool call that never returns?"
                silent = f"{what} pid {pid} did not answer a health probe for {now - last:.0f} s"
                return f"{silent} (its event loop is blocked{why})"
        return None

    async def _probe(self, pid: int, client: Any) -> None:
        """Ask once and wait for the answer as long as a silent worker may take. A busy loop (hundreds of rollouts
        a worker, each callback milliseconds of rendering and parsing) answers seconds late; each probe waiting only
        the probe interval for it read that as silence, and a working worker was killed after ``probe_timeout_s``
        with every rollout it held (one worker, 512 rollouts in flight). Silence now means no answer at all."""
        try:
            ok = await client.health(timeout=self.probe_timeout_s)
        except Exception:  # a socket of a dying worker: silence, like a timeout
            ok = False
        if ok:
            self._last_ok[pid] = time.monotonic()

    async def _forget(self, pid: int) -> None:
        if (probe := self._probes.pop(pid, None)) is not None:
            probe.cancel()
        self._last_ok.pop(pid, None)
        if (known := self._clients.pop(pid, None)) is not None:
            with contextlib.suppress(Exception):
                await known[1].close()

    async def close(self) -> None:
        for pid in self._probes.keys() | self._last_ok.keys() | self._clients.keys():
            await self._forget(pid)


def worker_client(path: str) -> Any:
    """A verifiers client of the pool worker listening on the unix socket ``path``."""
    from verifiers.v1.serve.client import EnvClient

    return EnvClient(f"ipc://{path}")
