"""Which host uid and cgroup an execution runs as, and when they may be lent again.

The pool's uids: ``uid_base`` is its zygotes' root, ``uid_base + 1 + slot`` the execution in slot ``slot`` (one per
concurrent execution), and above those one uid per open workspace. An execution that ended with a verdict has no
process left (its supervisor returned from ``wait4`` of the PID namespace's init), so its slot is free at once. Any
other end (a verdict marked ``unreaped``, cancelled, its supervisor or zygote killed, no verdict in time) puts the
slot in quarantine: the pool kills what still runs in it (its cgroup, or every host process of its uid where there
are no cgroups) and lends it again only when nothing is left, however long that takes. A uid is never shared by two executions that might both
have a live process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prime_orchestrator.sandbox.cgroups import Cgroups

logger = logging.getLogger(__name__)
NUM_WORKSPACES = 1024  # uids above the execution range, one per live workspace (verifiers runtimes)
SETTLED_BYTES = 4 << 20
"""Memory an execution may leave charged to its slot's cgroup (past its page cache) when the slot is lent again."""
SETTLE_S = 0.5
"""How long a slot waits at most for the memory its last execution left to be freed (:meth:`Leases.settle`): the
kernel's unix GC freed 65-77 MiB of descriptors left in flight in about 40 ms on the test VM."""

RECLAIMS = 3
"""How many times :meth:`Leases.settle` has the kernel reclaim a slot's charge (``Cgroups.reclaim``, tens of ms each)
before it only waits: one pass left 2-5 MiB of 20 MiB of negative dentries on the test VM."""


@dataclass
class Workspace:
    """A persistent /work: a tmpfs of ``disk_mb`` inside one zygote's mount namespace, owned by ``uid``."""

    name: str
    uid: int
    disk_mb: int
    zygote: object
    running: int = 0
    tainted: bool = False  # an execution of it ended without a verdict: processes of its uid may be left
    closed: bool = False


@dataclass
class Lease:
    slot: int
    uid: int
    cgroup: str
    workspace: Workspace | None = None
    acquired: float = field(default_factory=time.monotonic)


def processes_of(uid: int) -> list[int]:
    """Host pids of the live (not zombie) processes whose real uid is ``uid``: one pass over /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        state, uids = fields.get(b"State", b"").split(), fields.get(b"Uid", b"").split()
        if uids and int(uids[0]) == uid and state and state[0] not in (b"Z", b"X"):
            found.append(int(entry.name))
    return found


def uid_of(pid: int) -> int | None:
    """The real uid of the process that has ``pid`` now, or None when none has it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def kill_listed(pids: list[int], still_listed) -> int:
    """SIGKILL each of ``pids`` that ``still_listed(opened)`` (those of the pids opened that are the slot's processes
    now) still names once a pidfd of it is open, through that pidfd; how many were signalled.

    A pid read from a list (``cgroup.procs``, a scan of /proc) may belong to a process that exited since, and the
    number to an unrelated process after a wrap of ``pid_max`` (32,768 on the test VM: a second of a neighbour's
    fork loop). A pidfd names one process for good; the pid still listed after it was opened was that process's
    (had it exited in between, the pidfd's signal finds nothing), so no other process is ever signalled."""
    pidfds = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            pidfds[pid] = os.pidfd_open(pid)
    try:
        listed, killed = still_listed(list(pidfds)), 0
        for pid, pidfd in pidfds.items():
            if pid in listed:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed += 1
        return killed
    finally:
        for pidfd in pidfds.values():
            os.close(pidfd)


class Leases:
    def __init__(self, max_concurrency: int, uid_base: int, cgroups: Cgroups | None) -> None:
        self.uid_base = uid_base
        self.cgroups = cgroups
        self._slots = deque(range(max_concurrency))  # first in, first out: a uid is reused as late as possible
        self._available = asyncio.Semaphore(max_concurrency)
        first_ws = uid_base + 1 + max_concurrency
        self._ws_uids = deque(range(first_ws, first_ws + NUM_WORKSPACES))
        self.quarantined = 0
        self.in_use = 0
        self._floor: dict[str, int] = {}  # per slot cgroup, what Leases.settle found did not go within its bound
        # One thread for every slot's reclaims (tens of ms of kernel time each): the pool spends at most one core on
        # them, and its loop's default executor (zygote starts) never waits behind them.
        self._reclaimer = ThreadPoolExecutor(1, thread_name_prefix="sandbox-reclaim")

    async def acquire(self, workspace: Workspace | None) -> Lease:
        await self._available.acquire()
        self.in_use += 1
        slot = self._slots.popleft()
        if workspace is None:
            return Lease(slot, self.uid_base + 1 + slot, f"s{slot}")
        workspace.running += 1
        return Lease(slot, workspace.uid, f"w{workspace.uid}", workspace)

    def release(self, lease: Lease) -> None:
        self._slots.append(lease.slot)
        self.in_use -= 1
        self._available.release()
        if lease.workspace is not None:
            lease.workspace.running -= 1

    async def settle(self, lease: Lease) -> None:
        """Wait, at most :data:`SETTLE_S`, for the memory executions left charged to the slot's cgroup (past the page
        cache, beyond :data:`SETTLED_BYTES`) to be freed, so the next execution lent the slot gets its whole limit.

        Descriptors left in flight in a cycle of unix sockets (a /work file, full pipes: 65-77 MiB) outlive their
        execution until the kernel's unix GC, which closing a unix socket schedules, frees them in a kernel worker
        tens of ms after the verdict, and an execution's /work is freed when its supervisor exits, after the verdict;
        the next execution of a slot started within a few ms, and its ``memory_peak_mb`` (and its limit) counted what
        was left. After the bound the slot is lent again whatever is left (logged): a slow GC delays a slot, never the
        pool. What did not go within the bound (kernel memory the kernel reclaims only under pressure) is that slot's
        floor until it does: later executions wait only for what they add to it."""
        if self.cgroups is None or lease.workspace is not None:  # a workspace's files stay charged to it, on purpose
            return
        try:
            await self._settle(lease.cgroup)
        except OSError as e:  # its cgroup gone (the pool closing): nothing to wait for
            logger.debug("sandbox slot %s: cannot read its memory charge (%s)", lease.cgroup, e)

    async def _settle(self, key: str) -> None:
        settled = self._floor.get(key, 0) + SETTLED_BYTES
        if (left := self.cgroups.left_over(key, SETTLED_BYTES)) <= settled:
            self._floor[key] = min(self._floor.get(key, 0), left)
            return
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).close()  # schedules the GC (a killed supervisor did not)
        deadline, reclaims = time.monotonic() + SETTLE_S, 0
        while (left := self.cgroups.left_over(key, SETTLED_BYTES)) > settled and time.monotonic() < deadline:
            if reclaims < RECLAIMS:  # what the kernel frees only under pressure (negative dentries), freed now
                reclaims += 1
                reclaim = self._reclaimer.submit(self.cgroups.reclaim, key, left - settled)
                with contextlib.suppress(TimeoutError):  # queued behind other slots' past the bound: lent anyway
                    await asyncio.wait_for(asyncio.wrap_future(reclaim), max(0.0, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.002)
        if left > settled:
            logger.info(
                "sandbox slot %s: %.0f MiB left charged by its executions %.1f s after the last; lent again",
                key, left / (1 << 20), SETTLE_S,
            )  # fmt: skip
        self._floor[key] = left if left > settled else min(self._floor.get(key, 0), left)

    async def reap_and_release(self, lease: Lease) -> None:
        """Kill whatever of the lease still runs, wait until nothing is left, then release it."""
        self.quarantined += 1
        if lease.workspace is not None:
            lease.workspace.tainted = True
        try:
            await self._reap(lease.cgroup, lease.uid)
            await self.settle(lease)
        finally:
            self.quarantined -= 1
            self.release(lease)

    async def _reap(self, cgroup: str, uid: int) -> None:
        start, delay, warned = time.monotonic(), 0.02, False
        while True:
            if self.cgroups is not None:
                pids = self.cgroups.pids(cgroup)
            else:
                pids = await asyncio.to_thread(processes_of, uid)
            if not pids:
                return
            if self.cgroups is not None:
                kill_listed(pids, lambda _: set(self.cgroups.pids(cgroup)))
            else:
                kill_listed(pids, lambda opened: {pid for pid in opened if uid_of(pid) == uid})
            if not warned and time.monotonic() - start > 30:
                logger.warning(
                    "sandbox uid %d: %d process(es) still alive 30 s after SIGKILL; kept out of use", uid, len(pids)
                )
                warned = True
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    def open_workspace_uid(self) -> int:
        if not self._ws_uids:
            raise RuntimeError(f"all {NUM_WORKSPACES} sandbox workspaces are in use")
        return self._ws_uids.popleft()

    def unused_workspace_uid(self, uid: int) -> None:
        """Give back a uid from :meth:`open_workspace_uid` whose workspace never opened (nothing ran as it)."""
        self._ws_uids.append(uid)

    async def close_workspace_uid(self, ws: Workspace) -> None:
        """Give a closed workspace's uid back once none of its executions runs and nothing of it is left."""
        while ws.running:
            await asyncio.sleep(0.05)
        if ws.tainted:
            await self._reap(f"w{ws.uid}", ws.uid)
        self._ws_uids.append(ws.uid)
