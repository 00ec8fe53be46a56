"""What both apps share (prime's own on the torch engine, the shell around vLLM's in `prime_inference.vllm_app`):
the API-key check, ``X-Weight-Step`` on generation responses, our error envelope, and starting the engine."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from prime_core import progress
from prime_core.config.inference import InferenceConfig
from prime_core.schemas.errors import PERMANENT, PERMANENT_FAULT_HEADER
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


def error(message: str, status_code: int, param: str | None = None, permanent: bool = False) -> FastJSONResponse:
    headers = {PERMANENT_FAULT_HEADER: PERMANENT} if permanent else None
    return FastJSONResponse(error_body(message, status_code, param), status_code=status_code, headers=headers)


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


class CancelOnDisconnect:
    """ASGI middleware: a generation request whose client disconnects before its response is complete is cancelled,
    which aborts its sequences in the engine (vLLM's ``with_cancellation``). Streams stopped on a disconnect already;
    a non-streaming request (a client that timed out and retries) ran to the end for nobody, holding its batch slots.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        body_read, response_sent = asyncio.Event(), asyncio.Event()

        async def app_receive() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_sent.set()

        async def disconnected() -> None:
            await body_read.wait()  # until then the app reads the body (and sees a disconnect itself)
            while (await receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not response_sent.is_set():
                task.cancel()  # the client left: nobody reads the answer
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
            await task
        finally:
            task.cancel()
            watcher.cancel()


def add_common(app: FastAPI, config: InferenceConfig) -> None:
    """API-key check on every route, ``X-Weight-Step`` on generation responses, cancelling generation requests whose
    client left, and our error envelope on our routes."""
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(AuthAndWeightStep, api_key=config.server.resolved_api_key())

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return error(exc.message, exc.status_code, exc.param, exc.permanent)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error(f"internal error: {type(exc).__name__}", 500)


async def start_engine(config: InferenceConfig, engine_factory: EngineFactory) -> ServerState:
    from prime_inference.tool_calling import resolve_tool_calling

    with progress.activity(f"loading {config.model.name} and starting the engine"):
        engine, tokenizer = await asyncio.to_thread(engine_factory)
        await engine.start()
    progress.current().add_counters(lambda: _load(engine))
    config, tool_line = resolve_tool_calling(config, tokenizer, engine.name)
    logger.info("serving %s with the %s engine", config.served_model_name, engine.name)
    logger.info(tool_line)
    return ServerState(config, engine, tokenizer)


def _load(engine: Engine) -> dict[str, float]:
    """The engine's load and progress, for the heartbeat file."""
    info = engine.info
    load = {"running": info.running, "waiting": info.waiting, "weight_step": info.weight_step}
    return load | ({"engine_steps": info.steps} if info.steps is not None else {})
