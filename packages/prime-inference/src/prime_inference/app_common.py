"""What both apps share (prime's own on the torch engine, the shell around vLLM's in `prime_inference.vllm_app`):
the API-key check, ``X-Weight-Step`` on generation responses, our error envelope, and starting the engine."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from prime_core.config.inference import InferenceConfig
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prime_inference.engines.base import Engine
from prime_inference.protocol import RequestError, error_body
from prime_inference.routes import generate
from prime_inference.serving import FastJSONResponse, ServerState

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", *generate.GENERATE_ROUTES})
EngineFactory = Callable[[], tuple[Engine, Any]]


def error(message: str, status_code: int, param: str | None = None) -> FastJSONResponse:
    return FastJSONResponse(error_body(message, status_code, param), status_code=status_code)


class AuthAndWeightStep:
    """ASGI middleware: the API-key check on every route and ``X-Weight-Step`` on generation responses.

    Plain ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` re-streams every response
    through a task and a memory channel, a cost every rollout request would pay."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and not self._authorized(scope):
            response = error("missing or invalid API key (Authorization: Bearer <key>)", 401)
            return await response(scope, receive, send)
        if scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        # The step served when the request starts: an update while it runs waits for it (see docs/inference.md).
        step = str(scope["app"].state.prime.engine.info.weight_step)

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Weight-Step", step)
            await send(message)

        await self.app(scope, receive, stamped)


def add_common(app: FastAPI, config: InferenceConfig) -> None:
    """API-key check on every route, ``X-Weight-Step`` on generation responses, and our error envelope on our routes."""
    app.add_middleware(AuthAndWeightStep, api_key=config.server.api_key)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return error(exc.message, exc.status_code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error(f"internal error: {type(exc).__name__}", 500)


async def start_engine(config: InferenceConfig, engine_factory: EngineFactory) -> ServerState:
    from prime_inference.tool_calling import resolve_tool_calling

    engine, tokenizer = await asyncio.to_thread(engine_factory)
    await engine.start()
    config, tool_line = resolve_tool_calling(config, tokenizer, engine.name)
    logger.info("serving %s with the %s engine", config.served_model_name, engine.name)
    logger.info(tool_line)
    return ServerState(config, engine, tokenizer)
