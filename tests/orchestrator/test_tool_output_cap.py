"""``prime_chat.tool_output``: the transport under the chat harness's MCP client reads no more than its cap."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from prime_chat.tool_output import CappedTransport, cut_marker, text_head

CAP = 1000


class Chunks(httpx2.AsyncByteStream):
    """A body in 64-byte chunks, as a socket delivers it."""

    def __init__(self, body: bytes):
        self.body = body

    async def __aiter__(self):
        for i in range(0, len(self.body), 64):
            yield self.body[i : i + 64]


def answer(body: bytes, content_type: str = "application/json") -> CappedTransport:
    async def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": content_type}, stream=Chunks(body))

    return CappedTransport(httpx2.MockTransport(handler), CAP)


def post(transport, call: dict) -> httpx2.Response:
    async def go():
        async with httpx2.AsyncClient(transport=transport) as client:
            response = await client.post("http://tools/mcp", json=call)
            await response.aread()
            return response

    return asyncio.run(go())


def tool_answer(text: str) -> bytes:
    result = {"content": [{"type": "text", "text": text}], "structuredContent": {"result": text}}
    return json.dumps({"jsonrpc": "2.0", "id": 7, "result": result}).encode()


CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "read", "arguments": {}}}


def test_an_answer_under_the_cap_is_read_unchanged():
    body = tool_answer("short")
    assert post(answer(body), CALL).content == body


def test_a_tool_answer_over_the_cap_is_its_head_and_a_marker():
    text = "line one\n" + "é" * 2000
    result = post(answer(tool_answer(text)), CALL).json()
    assert result["id"] == 7 and result["result"]["isError"] is True
    shown = result["result"]["content"][0]["text"]
    head, marker = shown.rsplit("\n", 1)
    assert marker == cut_marker(CAP) and text.startswith(head) and len(head) > 100


def test_another_request_over_the_cap_is_an_error_answer():
    result = post(answer(b'{"jsonrpc": "2.0", "id": 3, "result": {"tools": [' + b" " * 2000 + b"]}}"),
                  {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}).json()  # fmt: skip
    assert result == {"jsonrpc": "2.0", "id": 3, "error": {"code": -32603, "message": cut_marker(CAP)}}


def test_a_stream_over_the_cap_breaks_off():
    """An SSE answer (or one that never ends) stops being read at the cap: the MCP client fails the call."""
    with pytest.raises(httpx2.ReadError, match="over 1,000 bytes"):
        post(answer(b"data: " + b"x" * 5000 + b"\n\n", "text/event-stream"), CALL)


@pytest.mark.parametrize(
    "body, head",
    [
        (b'{"text":"a\\"b\\\\c\\u00e9', 'a"b\\cé'),  # escapes whole
        (b'{"text":"ab\\u00', "ab"),  # a cut escape is left out
        (b'{"text":"ab\\', "ab"),
        (b'{"text":"x\\ud83d', "x?"),  # half a surrogate pair: replaced, so the head encodes
        (b'{"text":"done"},{"text":"next', "done"),  # the first string only
        (b'{"image":"AAAA', ""),
    ],
)
def test_text_head(body, head):
    assert text_head(body) == head


def test_the_chat_program_reads_tool_servers_through_the_cap():
    from prime_chat import tool_output
    from prime_chat.harness import chat_program

    assert chat_program()["mcp_client"] is tool_output.mcp_client


def test_the_cap_is_a_setting_of_the_chat_harness(monkeypatch):
    from prime_core.config.orchestrator import EnvConfig
    from prime_orchestrator.env_config import env_config_data, resolve

    from tests.fixtures.vf import use_vf_envs

    use_vf_envs(monkeypatch)
    for harness, cap in [({"harness": "null"}, 16 * 2**20),
                         ({"harness": "prime-chat", "harness_args": {"max_tool_output_bytes": 4096}}, 4096)]:  # fmt: skip
        config = resolve(env_config_data(EnvConfig.model_validate({"id": "vf-flood", **harness})))
        assert (config.agent.harness.id, config.agent.harness.max_tool_output_bytes) == ("prime-chat", cap)
