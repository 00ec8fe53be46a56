"""A tool server's answer is bounded as it is read, before the MCP client holds it whole.

verifiers' chat loop cuts a tool result to 20 kB for the model (``bound_tool_message``), but only after its MCP
client has read, parsed and validated the whole answer in the env server: a tool that printed 200 MiB (a policy can
make a shell tool ``cat`` anything) took the env server from 0.7 to 3.1 GB of RSS for one call (the JSON body holds
the text twice, ``content`` and ``structuredContent``, escaped; then its parse, its model and the cut each copy
it), and concurrent rollouts multiply that. Here the HTTP transport under the MCP client stops reading an answer at
``max_bytes``: a JSON answer to a tool call becomes a result holding the head of its text and a marker saying what
was cut. A streamed (SSE) answer is passed on event by event while it stays under the cap; what would run past it
(one huge answer, or an endless stream of small events), or one event larger than the MCP client's SSE parser takes
(1 MiB, the call fails past it), is cut the same way and ends the stream.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import Any

import httpx2

HEAD_BYTES = 16_000
"""Bytes of the answer's JSON text kept before the marker: under verifiers' own 20 kB cut, which would hide it."""

_TEXT_KEY = re.compile(rb'"text"\s*:\s*"')
# A JSON string's body up to its closing quote or the end of what was read, whole escapes only.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


def cut_marker(max_bytes: int) -> str:
    return f"[... cut: the tool's answer is over {max_bytes:,} bytes; this is its beginning ...]"


def text_head(body: bytes) -> str:
    """The beginning of the first ``"text"`` string of a JSON body cut short (empty when there is none)."""
    start = _TEXT_KEY.search(body)
    if start is None:
        return ""
    raw = body[start.end() : start.end() + HEAD_BYTES].decode("utf-8", errors="ignore")
    head = json.loads('"' + _STRING_BODY.match(raw).group(0) + '"')
    return head.encode("utf-8", errors="replace").decode("utf-8")  # half a surrogate pair may end the cut


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
SSE_EVENT_BYTES = inspect.signature(httpx2.EventSource).parameters["max_event_size"].default
"""The largest SSE event the MCP client's ``EventSource`` parses (1 MiB): past it the call fails, so a streamed
answer is cut below it."""


class _CappedEvents(httpx2.AsyncByteStream):
    """An SSE body passed on whole event by whole event while it stays under ``max_bytes``; what would run past the
    cap, or one event past ``SSE_EVENT_BYTES``, becomes ``cut(its bytes)`` (which raises when there is nothing to
    cut it to) and the stream ends there."""

    def __init__(self, inner: Any, max_bytes: int, cut: Any):
        self.inner, self.max_bytes, self.cut = inner, max_bytes, cut
        self.event_bytes = min(max_bytes, SSE_EVENT_BYTES or max_bytes)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        pending, scanned, passed = bytearray(), 0, 0
        async for chunk in self.inner:
            pending += chunk
            # Scan only what is new (less a separator's length): one huge event is not searched over and over.
            ends = list(_EVENT_END.finditer(pending, max(scanned - 3, 0)))
            scanned = len(pending)
            if ends and passed + ends[-1].end() <= self.max_bytes:
                whole = ends[-1].end()
                yield bytes(pending[:whole])
                passed += whole
                del pending[:whole]
                scanned = len(pending)
            if passed + len(pending) > self.max_bytes or len(pending) > self.event_bytes:
                yield self.cut(bytes(pending))
                return
        if pending:
            yield bytes(pending)

    async def aclose(self) -> None:
        await self.inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport that reads at most ``max_bytes`` of any response body."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int):
        self.inner, self.max_bytes = inner, max_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").lower().startswith("application/json"):
            response.stream = _CappedEvents(
                response.stream, self.max_bytes, lambda event: self._cut_event(request, event)
            )
            return response
        body = bytearray()
        try:
            async for chunk in response.stream:
                body += chunk
                if len(body) > self.max_bytes:
                    return self._cut(request, bytes(body))
        finally:
            await response.stream.aclose()
        return httpx2.Response(
            response.status_code, headers=response.headers, content=bytes(body), extensions=response.extensions
        )

    def _cut(self, request: httpx2.Request, body: bytes) -> httpx2.Response:
        return httpx2.Response(200, json=self._cut_answer(request, body), request=request)

    def _cut_event(self, request: httpx2.Request, event: bytes) -> bytes:
        data = json.dumps(self._cut_answer(request, event), ensure_ascii=False)
        return f"event: message\ndata: {data}\n\n".encode()

    def _cut_answer(self, request: httpx2.Request, body: bytes) -> dict[str, Any]:
        """The JSON-RPC answer of a call whose answer ran past the cap: the head of a tool's text and a marker."""
        try:
            call = json.loads(request.content)
        except ValueError:
            call = None
        if not isinstance(call, dict) or "id" not in call:
            raise httpx2.ReadError(f"the server's answer is over {self.max_bytes:,} bytes", request=request)
        marker = cut_marker(self.max_bytes)
        if call.get("method") == "tools/call":
            text = text_head(body) + "\n" + marker
            # resultType: the 2026-07-28 protocol requires it; the older ones ignore it (MCP's surface models)
            answer = {
                "result": {"content": [{"type": "text", "text": text}], "isError": True, "resultType": "complete"}
            }
        else:
            answer = {"error": {"code": -32603, "message": marker}}
        return {"jsonrpc": "2.0", "id": call["id"], **answer}

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def mcp_client(spec: dict[str, Any]) -> AsyncIterator[Any]:
    """verifiers' ``mcp_client`` (its bundled chat program's: one fresh MCP client in the caller's task, teardown
    failures after the body suppressed), its HTTP client on a ``CappedTransport`` of ``spec["max_output_bytes"]``.
    The MCP SDK's ``create_mcp_http_client`` takes no transport, so its one default is spelled here: redirects."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    stack = AsyncExitStack()
    try:
        http_client = await stack.enter_async_context(
            httpx2.AsyncClient(
                follow_redirects=True,
                headers=spec.get("headers") or None,
                timeout=httpx2.Timeout(spec.get("timeout", 600.0), connect=spec.get("connect_timeout", 5.0)),
                transport=CappedTransport(httpx2.AsyncHTTPTransport(), spec["max_output_bytes"]),
            )
        )
        transport = streamable_http_client(spec["url"], http_client=http_client)
        yield await stack.enter_async_context(Client(transport))
    finally:
        with suppress(Exception):
            await stack.aclose()
