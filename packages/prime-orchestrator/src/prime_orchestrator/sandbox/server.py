"""A sandbox node: the local pool behind HTTP, for orchestrators that spread executions over many nodes.

Routes: ``POST /execute`` (body :class:`ExecRequest`, reply :class:`ExecResult`), ``GET /health`` (the pool's
:class:`SandboxHealth`), ``POST /workspaces`` (optional body ``{"disk_mb": N}``) and ``DELETE /workspaces/{name}``
(persistent /work for the verifiers runtime; names are random). With ``api_key_var`` set, every route wants
``Authorization: Bearer <key>``; without it the config only allows a loopback address. Bodies over
``max_body_mb`` are refused (413) before they are read. The node holds at most :func:`connection_cap` connections
(what its open-files limit leaves once the pool has what it may need) and closes one that sends no request for
``idle_s`` (config): a flood of connections that send nothing cannot take the descriptors the pool needs for the executions
it has accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import resource
import socket

from aiohttp import web
from prime_core.config.sandbox import SandboxNodeConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prime_orchestrator.sandbox.cgroups import FDS_PER_KEY, lift_open_files
from prime_orchestrator.sandbox.pool import OTHER_FDS, SandboxPool
from prime_orchestrator.sandbox.schemas import ExecRequest

logger = logging.getLogger(__name__)
POOL = web.AppKey("pool", SandboxPool)
# Descriptors the pool holds per running execution (request and stdin memfds, result pipe, the supervisor's pidfd)
# with its connection.
FDS_PER_EXECUTION = 8
MAX_CONNECTIONS = 16384
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


async def execute(request: web.Request) -> web.Response:
    try:
        req = ExecRequest.model_validate_json(await request.read())
    except ValidationError as e:
        return web.json_response({"error": f"invalid request: {e.errors()[0]['msg']}"}, status=422)
    result = await request.app[POOL].execute(req)
    return web.Response(body=result.model_dump_json(), content_type="application/json")


class _WorkspaceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    disk_mb: int | None = Field(default=None, ge=1, le=1 << 16)


async def open_workspace(request: web.Request) -> web.Response:
    try:
        body = _WorkspaceBody.model_validate_json(await request.read() or b"{}")
    except ValidationError as e:
        return web.json_response({"error": f"invalid request: {e.errors()[0]['msg']}"}, status=422)
    try:
        name = await request.app[POOL].open_workspace(body.disk_mb)
    except RuntimeError as e:
        return web.json_response({"error": str(e)}, status=503)
    return web.json_response({"name": name})


async def close_workspace(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await request.app[POOL].close_workspace(name):
        return web.json_response({"error": f"no open workspace {name!r}"}, status=404)
    return web.json_response({"closed": name})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **request.app[POOL].health().model_dump()})


def _auth(key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        sent = request.headers.get("Authorization", "")
        if key and not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    return check


def connection_cap(config: SandboxNodeConfig) -> int:
    """Connections the node holds at once: its open-files limit (raised to its hard limit) less what the pool may
    need. Without a cap, 1,500 connections that sent nothing took every descriptor of a node limited to 1,500, and
    executions it had accepted ended as ``sandbox_error`` (the pool could not open their pipes)."""
    mc = config.pool.max_concurrency
    need = (FDS_PER_KEY + FDS_PER_EXECUTION) * mc + OTHER_FDS
    lift_open_files(need + MAX_CONNECTIONS)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(mc, min(MAX_CONNECTIONS, soft - need))


class Listener:
    """Accepts connections for ``runner`` on every address ``host`` names while it holds fewer than ``cap``; above
    that they wait in the kernel's queue (a client's connect then times out, which sends its request to another
    node)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, cap: int) -> None:
        self.socks: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                sock = socket.socket(family, kind, proto)
                self.socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio's servers: an IPv4 address has a socket of its own
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(1024)
                sock.setblocking(False)
                port = port or sock.getsockname()[1]  # port 0: the others take the port the first was given
        except OSError:
            for sock in self.socks:
                sock.close()
            raise
        self.port = self.socks[0].getsockname()[1]
        self.cap = cap
        self._server = runner.server
        self._tasks = [asyncio.ensure_future(self._accept(sock)) for sock in self.socks]

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        short = False
        while True:
            if len(self._server.connections) >= self.cap:  # wait for one to close (idle ones do within idle_s)
                await asyncio.sleep(0.05)
                continue
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                if e.errno not in _OUT_OF_FDS:  # the client gave up (ECONNABORTED, ...): take the next one
                    await asyncio.sleep(0.01)  # and never spin on an error that lasts
                    continue
                if not short:
                    logger.warning("sandbox node: cannot accept connections: %s", e.strerror)
                short = True
                await asyncio.sleep(0.5)
                continue
            short = False
            try:
                await loop.connect_accepted_socket(self._server, conn)
            except OSError:
                conn.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self.socks:
            sock.close()


def build_app(config: SandboxNodeConfig) -> web.Application:
    """The node's app; the pool starts with the app and closes with it."""
    key = os.environ.get(config.api_key_var) if config.api_key_var else None
    if config.api_key_var and not key:
        raise ValueError(f"api_key_var: environment variable {config.api_key_var} is not set")
    app = web.Application(middlewares=[_auth(key)], client_max_size=config.max_body_mb << 20)

    async def lifecycle(app: web.Application):
        pool = SandboxPool(config.pool)
        await pool.start()
        app[POOL] = pool
        logger.info("sandbox pool ready: %d zygote(s), %d slots", pool.num_zygotes, config.pool.max_concurrency)
        yield
        await pool.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/execute", execute)
    app.router.add_get("/health", health)
    app.router.add_post("/workspaces", open_workspace)
    app.router.add_delete("/workspaces/{name}", close_workspace)
    return app
