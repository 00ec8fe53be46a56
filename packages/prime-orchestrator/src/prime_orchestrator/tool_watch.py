"""Tool servers of an env server: found in its process tree, probed, and named when they die or hang.

verifiers starts a taskset's shared (taskset-scoped) tool servers once per env worker, as ``python -m <toolset>``
children of the worker with ``VF_CONFIG`` and ``MCP_PORT_FILE`` (or ``MCP_PORT``) in their environment and no rollout's
state channel (``VF_STATE_URL`` empty). Nothing in verifiers restarts one: a shared server that exits leaves every
later rollout of its worker calling a dead port, one whose event loop blocks (a synchronous tool that never returns)
leaves them waiting for the tool timeout. ``ToolWatch`` tells ``env_watch.HangWatch`` either way, and the env server is
replaced like a hung worker (its in-flight rollouts re-run). A task-scoped server lives for one rollout: its failure
fails that rollout only, which the rollout's own timeout bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from prime_core.io import read_regular

from prime_orchestrator.proc_tree import command


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _port(env: dict[str, str]) -> int | None:
    if env.get("MCP_PORT", "").isdigit():
        return int(env["MCP_PORT"])
    with contextlib.suppress(OSError, ValueError):
        # Only a small regular file: a FIFO under the name blocked the orchestrator's watch in open for good.
        return int(read_regular(env["MCP_PORT_FILE"], "a port file", limit=64).strip())
    return None


def shared_tool_server(pid: int) -> tuple[bool, int | None]:
    """(whether ``pid`` is a shared tool server, its port once it wrote it)."""
    env = _environ(pid)
    shared = "VF_CONFIG" in env and ("MCP_PORT_FILE" in env or "MCP_PORT" in env) and not env.get("VF_STATE_URL")
    return shared, _port(env) if shared else None


async def http_answers(port: int, timeout: float) -> bool:
    """Whether anything answers HTTP on 127.0.0.1:``port`` within ``timeout`` (MCP answers a bare GET with 406). A
    connection alone proves nothing: the kernel accepts it for a server whose event loop is blocked."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        writer.write(b"GET /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return (await asyncio.wait_for(reader.readline(), timeout)).startswith(b"HTTP/")
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


class ToolWatch:
    """The shared tool servers of one env server's tree: which exited, which stopped answering."""

    def __init__(self, probe_timeout_s: float, probe_every_s: float):
        self.probe_timeout_s = probe_timeout_s
        self.probe_every_s = probe_every_s
        self._kind: dict[int, tuple[int, bool]] = {}
        """pid -> (its parent, whether it is a shared tool server) of each process of the tree, read once."""
        self._servers: dict[int, tuple[int, str]] = {}
        """pid -> (its parent, its command) of each shared tool server alive at the last look."""
        self._ports: dict[int, int] = {}
        self._last_ok: dict[int, float] = {}

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    def gone(self, tree: dict[int, tuple[int, str]]) -> str | None:
        """Note new tool servers in ``tree`` (pid -> (parent, state)); name one that exited while its worker lives.
        What is known of a process that left the tree is dropped (a server whose worker went too: over days of worker
        restarts these added up); a pid found under another parent is another process (the pid reused)."""
        same = {pid for pid, (parent, _) in tree.items() if self._kind.get(pid, (parent,))[0] == parent}
        self._kind = {pid: known for pid, known in self._kind.items() if pid in same}  # short-lived pids come and go
        reason = None
        for pid in self._servers.keys() - same:
            parent, cmd = self._servers.pop(pid)
            port, _ = self._ports.pop(pid, None), self._last_ok.pop(pid, None)
            if reason is None and parent in tree:
                at = f" on port {port}" if port is not None else ""
                reason = f"tool server pid {pid} ({cmd}){at} exited; its worker pid {parent} cannot start another"
        for pid, (parent, _) in tree.items():
            if pid not in self._kind:
                self._kind[pid] = (parent, shared_tool_server(pid)[0])
                if self._kind[pid][1]:
                    self._servers[pid] = (parent, command(pid))
            if pid in self._servers and pid not in self._ports and (port := shared_tool_server(pid)[1]) is not None:
                self._ports[pid] = port
        return reason

    async def silent(self) -> str | None:
        """Probe every tool server with a port; name one that answered nothing for ``probe_timeout_s``."""
        targets = {pid: port for pid, port in self._ports.items() if pid in self._servers}
        answers = await asyncio.gather(*(http_answers(port, self.probe_every_s) for port in targets.values()))
        now = time.monotonic()
        for (pid, port), ok in zip(targets.items(), answers, strict=True):
            last = self._last_ok.setdefault(pid, now)
            if ok:
                self._last_ok[pid] = now
            elif now - last > self.probe_timeout_s:
                cmd = self._servers[pid][1]
                return (
                    f"tool server pid {pid} ({cmd}) did not answer on port {port} for {now - last:.0f} s "
                    "(its event loop is blocked: a tool that never returns?)"
                )
        return None
