"""A tool server's answer is bounded as it is read, before the MCP client holds it whole.

verifiers' chat loop cuts a tool result to 20 kB for the model (``bound_tool_message``), but only after its MCP
client has read, parsed and validated the whole answer in the env server: a tool that printed 200 MiB (a policy can
make a shell tool ``cat`` anything) took the env server from 0.7 to 3.1 GB of RSS for one call (the JSON body holds
the text twice, ``content`` and ``structuredContent``, escaped; then its parse, its model and the cut each copy
it), and concurrent rollouts multiply that. Here the HTTP transport under the MCP client stops reading an answer at
``max_bytes``: a JSON answer to a tool call becomes a result holding the head of its text and a marker saying what
was cut; any other answer past the cap (an endless stream) fails as the MCP client fails a broken stream.
"""

from __future__ import annotations

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


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, max_bytes: int):
        self.inner, self.max_bytes = inner, max_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in self.inner:
            size += len(chunk)
            if size > self.max_bytes:
                raise httpx2.ReadError(f"the tool server's answer is over {self.max_bytes:,} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport that reads at most ``max_bytes`` of any response body."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int):
        self.inner, self.max_bytes = inner, max_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        if not response.headers.get("content-type", "").lower().startswith("application/json"):
            response.stream = _CappedStream(response.stream, self.max_bytes)
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
        return httpx2.Response(200, json={"jsonrpc": "2.0", "id": call["id"], **answer}, request=request)

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
