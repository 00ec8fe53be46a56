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


def sse(*messages: dict) -> bytes:
    """An MCP answer streamed as server-sent events, one per JSON-RPC message."""
    return b"".join(b"event: message\ndata: " + json.dumps(m).encode() + b"\n\n" for m in messages)


def post_events(transport, call: dict) -> list[dict]:
    """The JSON-RPC messages the MCP client's own SSE parser (``httpx2.EventSource``, 1 MiB an event) reads."""

    async def go():
        async with (
            httpx2.AsyncClient(transport=transport) as client,
            client.stream("POST", "http://tools/mcp", json=call) as response,
        ):
            return [json.loads(e.data) async for e in httpx2.EventSource(response)]

    return asyncio.run(go())


PROGRESS = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 0.5}}


def assert_cut(message: dict, text: str, cap: int = CAP) -> None:
    assert message["id"] == 7 and message["result"]["isError"] is True
    head, marker = message["result"]["content"][0]["text"].rsplit("\n", 1)
    assert marker == cut_marker(cap) and text.startswith(head) and len(head) > 100


def test_a_streamed_answer_under_the_cap_is_read_unchanged():
    body = sse(PROGRESS, json.loads(tool_answer("short")))
    assert post(answer(body, "text/event-stream"), CALL).content == body


def test_a_streamed_tool_answer_over_the_cap_is_its_head_and_a_marker():
    """Before, the stream broke off at the cap and the MCP client failed the call (the rollout with it)."""
    text = "line one\n" + "é" * 2000
    progress, cut = post_events(answer(sse(PROGRESS, json.loads(tool_answer(text))), "text/event-stream"), CALL)
    assert progress == PROGRESS
    assert_cut(cut, text)


def test_an_endless_stream_ends_at_the_cap_with_a_cut_answer():
    read = []

    class Endless(httpx2.AsyncByteStream):
        async def __aiter__(self):
            while len(read) < 10_000:
                read.append(1)
                yield sse({**PROGRESS, "params": {"progressToken": 1, "message": "still working " * 3}})

    async def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=Endless())

    messages = post_events(CappedTransport(httpx2.MockTransport(handler), CAP), CALL)
    assert len(read) < 20 and messages[-1]["id"] == 7 and messages[-1]["result"]["isError"] is True
    assert all(m["method"] == "notifications/progress" for m in messages[:-1])


def test_a_streamed_event_past_the_sse_parsers_limit_is_cut_below_it():
    """Under a 16 MiB cap a 3 MiB answer passed the cap but not the MCP client's 1 MiB SSE event limit."""
    text = "the quick brown fox\n" * (3 * 2**20 // 20)
    transport = CappedTransport(httpx2.MockTransport(lambda r: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, stream=Chunks(sse(json.loads(tool_answer(text)))))), 16 * 2**20)  # fmt: skip
    (cut,) = post_events(transport, CALL)
    assert_cut(cut, text, 16 * 2**20)


def test_a_stream_that_answers_no_call_breaks_off_at_the_cap():
    """A stream that is no call's answer (the MCP client's GET stream) has nothing to cut to: it fails as before."""
    with pytest.raises(httpx2.ReadError, match="over 1,000 bytes"):
        post(answer(b"data: " + b"x" * 5000 + b"\n\n", "text/event-stream"), {"jsonrpc": "2.0", "method": "x"})


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
