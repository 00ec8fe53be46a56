"""The env server's HTTP clients: httpx's API (which the OpenAI SDK and verifiers speak) over aiohttp's connection pool.

An env worker holds one connection per rollout in flight to the interception server and one to the inference
server, hundreds of each. httpx's own pool scans all of its connections on every request and every release (each a
``getpeername`` and a readability poll), so its CPU per request grows with the requests in flight: 3-15 ms with
64-512 in flight on a 2-core VM, where httpx over aiohttp's pool (``httpx-aiohttp``, the transport behind the OpenAI
SDK's aiohttp option) takes 0.7-0.8 ms (``benchmarks/http_pool.py``, docs/benchmarks.md). verifiers' engine client
also keeps only 100 idle connections, so past 100 rollouts in flight each turn opened a new one.

Each response is bounded as a whole (`Bounded`): httpx's read timeout restarts at every chunk, so a server that
trickles a byte a second held a rollout until its rollout timeout, and one that answers 500 MB had it read into the
env worker's memory. A response past its request's read timeout or past ``MAX_RESPONSE_BYTES`` (as decoded: a
compressed answer is decoded here) is cut, and a
warning names the server and the bound (the OpenAI SDK turns the error into "Request timed out." / "Connection
error.", which name neither). The read timeout also bounds the wait for a free connection of the pool and for
connecting; its error says which of the three it ran out in (`Phase`, from aiohttp's trace hooks).

An idle connection is kept `KEEPALIVE_S`, less than the servers that close theirs soonest: one the server closes as
a request goes out on it fails that request (a POST is not retried), and the OpenAI SDK called that "Request timed
out." (the transport maps aiohttp's disconnect to a connect timeout). A request the server drops unanswered now fails
naming the server and what it did, as does an answer cut short or reset part-way, or not HTTP at all (the OpenAI SDK
says "Connection error." for each, naming neither). A POST is never sent again: the server may have run it.

A token-in answer (``/inference/v1/generate``) whose ``finish_reason`` is not ``stop``, ``length`` or ``tool_calls``
(vLLM's ``abort``, a proxy's ``content_filter``, anything else) is answered to the caller as a 502 naming the server
and the value: the train client maps an unknown reason to None and verifiers trained the turn as if it ended, though
an aborted or filtered completion is cut at a point the policy never chose. The 502 fails the rollout (verifiers'
clients do not retry), with the reason in its error.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from prime_core.io import one_line

if TYPE_CHECKING:
    from verifiers.v1.configs.client import BaseClientConfig

logger = logging.getLogger("prime.orchestrator.http")

MAX_RESPONSE_BYTES = 256 * 2**20
"""Largest response body read: ~15x a 128k-token completion's ``/inference/v1/generate`` answer with log-probs."""

KEEPALIVE_S = 3.0
"""How long an idle connection is kept for reuse: under the 5 s after which uvicorn (``vllm serve``, by default)
closes one, with room for a loaded machine's late timers."""

GENERATE_PATH = "/inference/v1/generate"
FINISH_REASONS = ("stop", "length", "tool_calls")
"""What a turn may end with; verifiers' ``FinishReason``. Anything else fails the rollout."""
# A key of the answer's JSON, never text inside one of its strings (there every quote is escaped).
_FINISH = re.compile(rb'"finish_reason"\s*:\s*(null|"(?:[^"\\]|\\.)*")')


class ResponseTooLarge(httpx.ReadError):
    pass


class Phase:
    """Where a request of `Bounded` is before its answer's headers: queued for a free connection of the pool (all
    ``pool`` in use), connecting, or (neither) sent and waiting for the answer."""

    def __init__(self):
        self.queued, self.connecting, self.pool = False, False, 0


_PHASE: contextvars.ContextVar[Phase | None] = contextvars.ContextVar("prime_http_phase", default=None)
"""The `Phase` of the request this task sends (aiohttp runs a request's hooks in the task that sends it)."""


def _phase_hooks() -> aiohttp.TraceConfig:
    """aiohttp's trace hooks that keep `_PHASE` current. A cancelled wait sends no end hook: the phase stays."""

    def setting(**values):
        async def hook(session: aiohttp.ClientSession, ctx, params) -> None:
            if (phase := _PHASE.get()) is not None:
                for name, value in values.items():
                    setattr(phase, name, value)
                if values.get("queued"):
                    phase.pool = session.connector.limit if session.connector is not None else 0

        return hook

    hooks = aiohttp.TraceConfig()
    hooks.on_connection_queued_start.append(setting(queued=True))
    hooks.on_connection_queued_end.append(setting(queued=False))
    hooks.on_connection_create_start.append(setting(connecting=True))
    hooks.on_connection_create_end.append(setting(connecting=False))
    return hooks


class Bounded(httpx.AsyncBaseTransport):
    """``inner`` with each response done within its request's read timeout (headers and whole body, not per chunk)
    and no larger than ``MAX_RESPONSE_BYTES``."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limit_s = request.extensions.get("timeout", {}).get("read")
        deadline = None if limit_s is None else asyncio.get_running_loop().time() + limit_s
        phase = Phase()
        token = _PHASE.set(phase)
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.inner.handle_async_request(request)
        except TimeoutError:
            raise _timed_out(request, limit_s, phase) from None
        except httpx.ConnectTimeout as e:  # what the transport makes of every aiohttp connection error
            if (named := _connection_error(request, e, phase)) is None:
                raise
            raise named from e
        except aiohttp.ClientResponseError as e:  # an answer aiohttp cannot parse, which the transport passes raw
            raise _broken(request, f"answered what is not HTTP/1.1 ({e.message})") from e
        finally:
            _PHASE.reset(token)
        response.stream = _BoundedStream(response.stream, request, deadline, limit_s)
        if response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
            response = _decoded(request, response)
        # A streamed answer (server-sent events) says null in every chunk but its last: only whole answers are read.
        whole = response.headers.get("content-type", "").startswith("application/json")
        if (
            request.method == "POST"
            and request.url.path.endswith(GENERATE_PATH)
            and response.status_code == 200
            and whole
        ):
            return await _checked_finish(request, response)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, request: httpx.Request, deadline: float | None, limit_s: float):
        self.inner, self.request, self.deadline, self.limit_s = inner, request, deadline, limit_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        chunks = self.inner.__aiter__()
        while True:
            try:
                async with asyncio.timeout_at(self.deadline):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _timed_out(self.request, self.limit_s) from None
            except (httpx.ReadError, httpx.ConnectTimeout) as e:  # the transport's names for a cut or reset body
                raise _broken(self.request, f"the answer was cut after {size} bytes of its body ({e})") from e
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise _too_large(self.request)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _too_large(request: httpx.Request) -> ResponseTooLarge:
    message = f"{_server(request)}: response larger than {MAX_RESPONSE_BYTES} bytes; cut"
    logger.warning(message)
    return ResponseTooLarge(message, request=request)


def _decoded(request: httpx.Request, response: httpx.Response) -> httpx.Response:
    """``response`` with its body decoded here (gzip, deflate: what httpx asks for), bounded as decoded. httpx decodes
    after the transport, past `_BoundedStream`'s count: a 1 MiB gzip answer of zeros was read as 1 GiB (2.1 GB of
    RSS), and the finish-reason check skipped an encoded answer."""
    raw = httpx.Response(response.status_code, headers=response.headers, stream=response.stream, request=request)
    skip = (b"content-encoding", b"content-length")  # both describe the encoded body
    headers = [(k, v) for k, v in response.headers.raw if k.lower() not in skip]
    stream = _DecodedStream(raw, request)
    return httpx.Response(
        response.status_code, headers=headers, stream=stream, request=request, extensions=response.extensions
    )


class _DecodedStream(httpx.AsyncByteStream):
    def __init__(self, raw: httpx.Response, request: httpx.Request):
        self.raw, self.request = raw, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        chunks = self.raw.aiter_bytes()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except httpx.DecodingError as e:
                encoding = self.raw.headers["content-encoding"]
                raise _broken(self.request, f"its {encoding} body does not decode ({e})") from e
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:  # one chunk decodes to at most ~16 MiB (gzip's 1032x of 16 KiB)
                raise _too_large(self.request)
            yield chunk

    async def aclose(self) -> None:
        await self.raw.aclose()


async def _checked_finish(request: httpx.Request, response: httpx.Response) -> httpx.Response:
    """``response`` read whole (within its bounds), or a 502 naming the first finish reason no turn may end with."""
    try:  # a cut answer's connection is closed at once, as httpx does for the answers it reads itself
        body = b"".join([chunk async for chunk in response.stream])
    finally:
        await response.aclose()
    bad = next((m for m in _FINISH.findall(body) if m[1:-1].decode() not in FINISH_REASONS), None)  # decoded here
    if bad is None:
        return httpx.Response(200, headers=response.headers, content=body, extensions=response.extensions)
    value = json.loads(bad)
    message = (
        f"inference server {request.url.scheme}://{request.url.netloc.decode()} answered finish_reason {value!r} "
        f"(a turn ends with {', '.join(FINISH_REASONS)}): its completion is not trained"
    )
    logger.warning(message)
    return httpx.Response(502, json={"error": {"message": message, "type": "bad_finish_reason"}})


def _server(request: httpx.Request) -> str:
    return f"server {request.url.scheme}://{request.url.netloc.decode()} ({request.method} {request.url.path})"


def _connection_error(request: httpx.Request, error: httpx.ConnectTimeout, phase: Phase) -> httpx.TransportError | None:
    """The error the connection's failure is (None: another connect timeout). aiohttp says "Connection timeout to
    host" also when its pool timeout (httpx's ``pool``) ran out with no connection free."""
    cause = error.__cause__
    if isinstance(cause, aiohttp.ServerTimeoutError) and (phase.queued or phase.connecting):
        which = "pool" if phase.queued else "connect"
        limit = request.extensions.get("timeout", {}).get(which)
        message = f"{_server(request)}: {_waited(phase, f'after {limit}s (its {which} timeout)')}"
        logger.warning(message)
        return (httpx.PoolTimeout if phase.queued else httpx.ConnectTimeout)(message, request=request)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(f"{_server(request)}: cannot connect ({cause})", request=request)
    if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        message = f"{_server(request)}: the connection was closed before an answer ({cause})"
        logger.warning(message)
        return httpx.RemoteProtocolError(message, request=request)
    return None


def _broken(request: httpx.Request, what: str) -> httpx.RemoteProtocolError:
    """The server broke off or garbled its answer: one line naming it (the OpenAI SDK's own is "Connection error.")."""
    message = f"{_server(request)}: {one_line(what)}"
    logger.warning(message)
    return httpx.RemoteProtocolError(message, request=request)


def _timed_out(request: httpx.Request, limit_s: float, phase: Phase | None = None) -> httpx.ReadTimeout:
    """What the request waited for when its read timeout ran out, naming the server (before, always "response not
    complete", also for a request that never got a connection to send itself on)."""
    message = (
        f"{_server(request)}: {_waited(phase or Phase(), f'after {limit_s:g}s (its read timeout, client.timeout)')}"
    )
    logger.warning(message)
    return httpx.ReadTimeout(message, request=request)


def _waited(phase: Phase, bound: str) -> str:
    if phase.queued:
        return f"no connection free in the pool (all {phase.pool} in use by other requests) {bound}; nothing sent"
    if phase.connecting:
        return f"not connected {bound}; nothing sent"
    return f"response not complete {bound}"


def pooled_client(
    timeout: httpx.Timeout | None = None, max_connections: int | None = None, bounded: bool = False
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose connections live in one aiohttp pool (``max_connections`` None: unbounded;
    every idle connection is kept until aiohttp's keep-alive expiry; ``bounded``: each response `Bounded`). The CA
    bundle is httpx's; proxy variables are honoured as httpx does when any is set (aiohttp's ``trust_env`` looks them
    up in a thread on every request, so it stays off without them)."""

    def session() -> aiohttp.ClientSession:  # built on the first request, inside the event loop that uses it
        connector = aiohttp.TCPConnector(
            limit=max_connections or 0, ssl=httpx.create_ssl_context(), keepalive_timeout=KEEPALIVE_S
        )
        session = aiohttp.ClientSession(
            connector=connector,
            trust_env=bool(urllib.request.getproxies()),
            trace_configs=[_phase_hooks()] if bounded else None,
        )
        _keepers.add(asyncio.get_running_loop().create_task(_close_with_loop(session)))
        return session

    transport = AiohttpTransport(client=session)
    return httpx.AsyncClient(timeout=timeout, transport=Bounded(transport) if bounded else transport)


_keepers: set[asyncio.Task] = set()


async def _close_with_loop(session: aiohttp.ClientSession) -> None:
    """Close ``session`` when its event loop shuts down (``asyncio.run`` cancels this task), unless its owner did:
    a client held for the life of the process (one per event loop) has no owner to close it, and aiohttp reports
    every session that is collected open."""
    try:
        while not session.closed:
            await asyncio.sleep(5)
    finally:
        await session.close()
        _keepers.discard(asyncio.current_task())


def engine_client(config: BaseClientConfig) -> httpx.AsyncClient:
    """verifiers' ``build_async_httpx`` with the pooled transport: the same timeout and connection cap."""
    from verifiers.v1.clients.base import DEFAULT_LIMITS

    return pooled_client(httpx.Timeout(**config.timeout.model_dump()), DEFAULT_LIMITS.max_connections, bounded=True)


def pool_engine_clients() -> None:
    """Route verifiers' OpenAI clients (the train client's engine calls, judges) through ``engine_client``.
    verifiers builds them in one function and offers no hook for the transport; this process is ours."""
    from verifiers.v1.clients import base

    base.build_async_httpx = engine_client
