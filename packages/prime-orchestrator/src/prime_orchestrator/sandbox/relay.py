"""The host side of a program execution's routes: the only way out of its network namespace.

A harness program (verifiers' ``bash`` agent) calls the model through verifiers' interception server on this host's
loopback (``http://127.0.0.1:<port>/v1``, also its MCP tool servers). For such an execution the supervisor brings
loopback up in the execution's own network namespace, listens there on ``127.0.0.1:<port>`` for each route's port and
hands the listening sockets to the pool (:func:`supervisor._listen`); this relay accepts on them and copies the bytes
of each connection to and from ``127.0.0.1:<port>`` of the host, the same port, and never anywhere else: whatever
the code sends (another Host header, a ``CONNECT``, a request naming another port) reaches the route's server alone,
which answers it or not. The URL inside is the host's own, so the runtime's ``host_url`` changes nothing. Whatever
that server offers is the code's to drive (the model's commands run in the program's execution), so a route must be
served by this process or one it started (:func:`foreign`), checked when the runtime is given the routes.
Only the program's own connections are relayed, never those of the model's commands it runs (:func:`from_program`).

Bounded: at most :data:`MAX_CONNECTIONS` connections at once (more are refused at once), each copying :data:`CHUNK`
bytes at a time and waiting for the other side to take them (flow control), so the host holds at most a few of them per connection however much the code sends or leaves unread. Everything closes
with the execution: the pool calls :meth:`Relay.close` once its verdict is in (or it is killed), before the slot
is lent again.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable

logger = logging.getLogger(__name__)
MAX_CONNECTIONS = 32
"""Connections relayed at once for one execution (an agent loop holds one or two). One more is refused at once (reset):
queued in the listener's backlog instead, it waited for as long as the code held the 32, and the code (a process the
model's command left in the background) held them while the harness's next model call waited in that queue for
its HTTP timeout or the program's wall limit (900 s), the slot held all along."""
HOST_FDS = 3 * MAX_CONNECTIONS + 2
"""Descriptors of this process one program execution's relay may hold at most: each connection's two ends here and
the route server's end where that server runs in this process (verifiers' interception server does), its listener
and its socketpair. The pool counts them in the open-files limit it asks for (``lift_open_files``)."""
CHUNK = 64 << 10
"""Bytes read from one side before they are written to the other and drained."""
CONNECT_S = 10.0
"""Seconds to connect to the route's server on the host."""


# /proc/net/tcp{,6} local addresses a connection to 127.0.0.1 can land on, and the state of a listener.
_LOOPBACK_ADDRS = {"0100007F", "00000000", "0" * 32, "0000000000000000FFFF00000100007F"}
_LISTEN = "0A"


def _listeners(port: int) -> set[int]:
    """Socket inodes of the host's listeners that a connection to ``127.0.0.1:<port>`` can reach."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, _, hex_port = fields[1].partition(":")
                if fields[3] == _LISTEN and int(hex_port, 16) == port and addr in _LOOPBACK_ADDRS:
                    found.add(int(fields[9]))
    return found


def foreign(port: int) -> str:
    """Why ``port`` of the host's loopback may not be a program's route ('' when it may). A route is served by this
    process (verifiers' interception server) or by one of its descendants (a tool server verifiers launched): a
    route is relayed whole, so a port of any other host service (the inference server's weight and LoRA routes and
    ``/pause``, an orchestrator's, a node's), which an environment's toolset ``url`` can name, would be the
    policy's to drive. Read from /proc: 10 to 40 ms (2,000 descriptors open), once a rollout."""
    from prime_orchestrator.proc_tree import family

    wanted = _listeners(port)
    if not wanted:
        return "nothing listens there"
    for pid in family(os.getpid(), without_sandboxes=True):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        wanted.discard(int(link[8:-1]))
        if not wanted:
            return ""
    return "it is another host service's, not this process's nor one it started (a tool server verifiers launched)"


def _inits(pids: list[int]) -> list[int]:
    """Those of ``pids`` (host pids) that are the init of a PID namespace below the host's: an execution's code."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ns = line.split()[1:]
                    if len(ns) > 1 and ns[-1] == "1":
                        found.append(pid)
                    break
    return found


def _client_inode(pid: int, client_port: int, route_port: int) -> int | None:
    """The socket inode of the connection from ``client_port`` to ``route_port`` in ``pid``'s network namespace."""
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rpartition(":")[2], 16) == client_port and (
                    int(fields[2].rpartition(":")[2], 16) == route_port
                ):
                    return int(fields[9])
    return None


def from_program(conn: socket.socket, members: list[int]) -> bool:
    """Whether the execution's code itself (its PID namespace's init: the harness program) holds the other end of
    ``conn``, not a process it started (the model's commands). A route's servers answer whoever connects: verifiers'
    MCP tool servers take calls without its secret (a command calling a task's tool directly skipped the tool gate,
    the trace and the turn limits while its state writes landed), and its interception server answered a command's
    flood of unauthenticated requests at 3 s of this host's CPU per 0.6 s of the code's."""
    try:
        client_port, route_port = conn.getpeername()[1], conn.getsockname()[1]
    except OSError:
        return False
    for pid in _inits(members):
        inode = _client_inode(pid, client_port, route_port)
        if inode is None:
            continue
        with contextlib.suppress(OSError):
            return f"socket:[{inode}]" in {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    return False


class Relay:
    """The relay of one execution: the ports it may reach, and the connections it holds. ``members``, where the
    pool has the execution's cgroup: the host pids of its processes, so that only the program's own connections
    are relayed (:func:`from_program`)."""

    def __init__(self, ports: list[int], members: Callable[[], list[int]] | None = None) -> None:
        self.ports = list(dict.fromkeys(ports))
        self.members = members
        self.connections = 0  # relayed so far (for tests and logs)
        self.refused = 0  # refused over MAX_CONNECTIONS
        self.not_program = 0  # refused: opened by a process the program started, not by the program
        self._parent: socket.socket | None = None
        self._listeners: list[socket.socket] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self.closed = False

    def child(self) -> int:
        """A descriptor for the supervisor (the caller sends it, then closes it), on which it hands back its
        listeners. A new one per send: a request sent again to another zygote gets a fresh pair."""
        if self._parent is not None:
            self._parent.close()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)
        self._parent = parent
        self._spawn(self._receive(parent))
        return child.detach()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _receive(self, parent: socket.socket) -> None:
        # Unbounded here on purpose: close() (the execution's end) cancels it.
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(parent, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(parent)
        size = socket.CMSG_SPACE(len(self.ports) * array.array("i").itemsize)
        msg, ancdata, _, _ = parent.recvmsg(4096, size)
        fds = array.array("i")
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        listeners = [socket.socket(fileno=fd) for fd in fds]
        self._listeners.extend(listeners)
        ports = json.loads(msg) if msg else []
        if self.closed or ports != self.ports or len(listeners) != len(ports):
            self.close()
            return
        for listener, port in zip(listeners, ports, strict=True):
            listener.setblocking(False)
            self._spawn(self._accept(listener, port))

    async def _accept(self, listener: socket.socket, port: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors: closed, so that its callers are refused rather than left waiting
                logger.warning("relay of port %d: %s; its later connections are refused", port, e)
                listener.close()
                return
            if self._slots.locked():  # over the cap: refused now (reset), not left waiting (see MAX_CONNECTIONS)
                self.refused += 1
                _reset(conn)
                continue
            if self.members is not None and not await asyncio.to_thread(from_program, conn, self.members()):
                self.not_program += 1
                _reset(conn)
                continue
            await self._slots.acquire()  # free: takes no time
            self.connections += 1
            self._spawn(self._pipe(conn, port))

    async def _pipe(self, conn: socket.socket, port: int) -> None:
        writers: list[asyncio.StreamWriter] = []
        try:
            inner_r, inner_w = await asyncio.open_connection(sock=conn, limit=CHUNK)
            writers.append(inner_w)
            self._open.add(inner_w)
            async with asyncio.timeout(CONNECT_S):
                outer_r, outer_w = await asyncio.open_connection("127.0.0.1", port, limit=CHUNK)
            writers.append(outer_w)
            self._open.add(outer_w)
            await asyncio.gather(_copy(inner_r, outer_w, writers), _copy(outer_r, inner_w, writers))
        except (OSError, TimeoutError) as e:
            logger.debug("relay to port %d: %s", port, e)
        finally:
            for w in writers:
                self._open.discard(w)
                w.close()
            if not writers:
                conn.close()
            self._slots.release()

    def close(self) -> None:
        """Stop relaying: listeners, connections and tasks (idempotent; from the pool's loop)."""
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._open):
            w.close()
        self._open.clear()
        for s in [*self._listeners, *([self._parent] if self._parent else [])]:
            with contextlib.suppress(OSError):
                s.close()
        self._listeners.clear()
        self._parent = None


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, both: list) -> None:
    """``reader`` to ``writer`` until EOF (then half-close), at most :data:`CHUNK` held; an error closes both."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except OSError:
        for w in both:
            w.close()
