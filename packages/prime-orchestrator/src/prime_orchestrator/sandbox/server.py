"""A sandbox node: the local pool behind HTTP, for orchestrators that spread executions over many nodes.

Routes: ``POST /execute`` (body :class:`ExecRequest`, reply :class:`ExecResult`), ``GET /health`` (the pool's
:class:`SandboxHealth`), ``POST /workspaces`` (optional body ``{"disk_mb": N}``) and ``DELETE /workspaces/{name}``
(persistent /work for the verifiers runtime; names are random). With ``api_key_var`` set, every route wants
``Authorization: Bearer <key>``; without it the config only allows a loopback address. Bodies over
``max_body_mb`` are refused (413) before they are read.
"""

from __future__ import annotations

import hmac
import logging
import os

from aiohttp import web
from prime_core.config.sandbox import SandboxNodeConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prime_orchestrator.sandbox.pool import SandboxPool
from prime_orchestrator.sandbox.schemas import ExecRequest

logger = logging.getLogger(__name__)
POOL = web.AppKey("pool", SandboxPool)


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
