"""Clients that attack the server rather than use it: decompression bombs and host paths as images, bodies past the
limit without a Content-Length, grammars that take minutes to compile, prompts that take seconds to tokenize, slow
and idle connections, and clients that leave before their answer. Each is refused in one line naming the field (or
cut within a documented bound), and the server goes on serving everyone else."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
import subprocess
import sys
import time
import zlib

import httpx
import pytest
from prime_inference.protocol import RequestError
from prime_inference.structured import MAX_GRAMMAR_CHARS

from .helpers import start_server

KEEP_ALIVE = 2


@pytest.fixture(scope="module")
def hostile_server(model_dir):
    s = start_server(model_dir, server={"timeout_keep_alive": KEEP_ALIVE})
    yield s
    s.stop()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def assert_serving(server) -> None:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}
    r = httpx.post(f"{server.url}/v1/generate", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


# ---------------------------------------------------------------- images


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale PNG of ``width`` x ``height`` black pixels; with ``rows``, only that many rows of pixel data (the
    header still claims the full size)."""
    z = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    data = b"".join(z.compress(row) for _ in range(height if rows is None else rows)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from prime_core.vision import VisionSpec

    from tests.tiny import write_tiny_vl_model_dir

    path, _ = write_tiny_vl_model_dir(tmp_path_factory.mktemp("vl"), ["a red square"] * 8)
    return VisionSpec.from_model_dir(path)


def test_images_come_inline_and_bounded_in_pixels(vision, tmp_path):
    from prime_inference.multimodal import decode_images

    host_file = tmp_path / "secret.png"
    host_file.write_bytes(png(32, 32))
    assert len(decode_images([data_url(png(32, 32))], vision, "images").images) == 1
    refused = {
        # the server reads no host file (vLLM reads none without --allowed-local-media-path)
        str(host_file): "local path",
        f"file://{host_file}": "local path",
        "http://169.254.169.254/latest/meta-data": "remote",
        # 900M pixels in an 880 kB PNG: Pillow raises its own DecompressionBombError, which was a 500 and a traceback
        data_url(png(30_000, 30_000, rows=1)): "pixels",
        # past our bound but under Pillow's: decoded whole before (1.1 GB of RSS for one 12000x12000 PNG)
        data_url(png(6_000, 6_000)): "pixels",
        data_url(png(32, 32), "text/html"): "text/html",
        "data:image/png;base64,AAAA!!!": "base64",
        data_url(b"\x89PNG\r\n\x1a\n garbage"): "not a PNG",
    }
    breaches = []
    for source, expected in refused.items():
        try:
            decode_images([source], vision, "images")
            breaches.append((source[:60], "accepted"))
        except RequestError as e:
            if expected not in e.message or e.param != "images" or e.status_code != 400:
                breaches.append((source[:60], e.message))
        except Exception as e:  # the server answers these with a 500 and a traceback
            breaches.append((source[:60], repr(e)[:80]))
    assert breaches == []
    # Each under the bound, together past the request's: refused from the headers, nothing decoded.
    many = [data_url(png(5_000, 6_000, rows=1))] * 5
    with pytest.raises(RequestError, match="pixels together") as info:
        decode_images(many, vision, "messages")
    assert info.value.param == "messages"
    # vLLM's default limit_mm_per_prompt: 20,000 tiny images took 12 s and 1 GB before their placeholders were counted.
    with pytest.raises(RequestError, match="at most 999") as info:
        decode_images([data_url(png(8, 8))] * 1000, vision, "images")
    assert info.value.param == "images"


def test_other_clients_are_served_while_images_decode(hostile_server, monkeypatch):
    """Decoding runs off the event loop: two 31M-pixel images took 1.2 s to decode, during which no other request,
    /health included, was answered."""
    from prime_inference import multimodal

    def slow_decode(sources, vision, param):
        time.sleep(2.0)  # blocking, as Pillow is
        raise RequestError("decoded slowly", param=param)

    monkeypatch.setattr(multimodal, "decode_images", slow_decode)

    async def run() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"token_ids": [5, 6], "images": ["x"], "sampling_params": {"max_tokens": 2}}
            decoding = asyncio.ensure_future(client.post(f"{hostile_server.url}/v1/generate", json=body))
            await asyncio.sleep(0.3)
            latencies = []
            for _ in range(3):
                start = time.monotonic()
                assert (await client.get(f"{hostile_server.url}/health")).status_code == 200
                latencies.append(time.monotonic() - start)
            return await decoding, latencies

    answer, latencies = asyncio.run(run())
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "decoded slowly"
    assert max(latencies) < 1.0, latencies  # a blocked loop answers only after the 2 s decode


# ---------------------------------------------------------------- bodies


def test_a_chunked_body_past_the_limit_stops_being_read(monkeypatch):
    from prime_inference.routes import common
    from starlette.requests import Request

    monkeypatch.setattr(common, "MAX_BODY_BYTES", 1000)
    sent = []

    async def receive() -> dict:
        sent.append(100)
        return {"type": "http.request", "body": b" " * 100, "more_body": len(sent) < 1000}

    request = Request({"type": "http", "method": "POST", "headers": [], "path": "/v1/generate"}, receive)
    with pytest.raises(RequestError) as info:
        asyncio.run(common.read_json(request))
    # No Content-Length to refuse up front: reading stops at the limit, not after all 100 kB are held.
    assert info.value.status_code == 413
    assert sum(sent) <= 1000 + 100


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(hostile_server):
    text = "hello " * 200_000  # 1.2 MB; at 12 MB the tokenizer held the event loop for 9 s and took 1.6 GB
    for path, body, param in [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, "messages"),
        ("/tokenize", {"prompt": text}, "prompt"),
    ]:
        r = httpx.post(f"{hostile_server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (path, r.text[:200])
        error = r.json()["error"]
        assert error["param"] == param and "characters" in error["message"]
    assert_serving(hostile_server)


# ---------------------------------------------------------------- grammars


def test_grammars_too_large_to_compile_quickly_are_refused(hostile_server):
    def generate(structured: dict) -> httpx.Response:
        body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3, "structured_outputs": structured}}
        return httpx.post(f"{hostile_server.url}/v1/generate", json=body, timeout=60)

    attacks = {
        # 500k alternatives of one rule: llguidance's compile grows faster than linearly; this hung the server
        "choice": [str(i) for i in range(500_000)],
        # 200k alternatives in Lark: 43 s, then a Rust panic with its backtrace as the message
        "grammar": "start: " + " | ".join(f'"{i}"' for i in range(200_000)),
        "regex": "|".join(str(i) for i in range(100_000)),
        "json": {"type": "string", "enum": [f"v{i}" for i in range(100_000)]},
    }
    for key, value in attacks.items():
        r = generate({key: value})
        assert r.status_code == 400, (key, r.text[:200])
        error = r.json()["error"]
        assert error["param"] == f"structured_outputs.{key}" and "at most" in error["message"]
    # Errors from llguidance are one line, even where its message ran to a backtrace.
    r = generate({"regex": "(" * 5000 + "a" + ")" * 5000})
    assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
    # A grammar under the bound still works, for every one of n sequences.
    body = {
        "token_ids": [5, 6],
        "sampling_params": {"n": 8, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
    }
    r = httpx.post(f"{hostile_server.url}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert_serving(hostile_server)


def chained_rules(n: int) -> str:
    """A Lark grammar of ``n`` rules, each referring to the next."""
    return "start: a0\n" + "\n".join(f"a{i}: a{i + 1}" for i in range(n)) + f'\na{n}: "y"'


CHAIN_SCRIPT = """
import sys, threading
import transformers
from prime_inference.structured import GrammarState, check_grammar, request_grammar
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
grammar = request_grammar({"grammar": sys.argv[2]})
check_grammar(tokenizer, grammar)
thread = threading.Thread(target=lambda: print(int(GrammarState(tokenizer, grammar).allowed().sum())))
thread.start()
thread.join()
"""


def test_a_deeply_chained_grammar_does_not_crash_the_server(hostile_server, model_dir):
    """llguidance recurses once per level of rule references: 3000 chained rules (48 kB) overflowed the event loop's
    8 MB stack, a segfault that took the server down for everyone. Compiled on a large stack, it just works, in the
    engine thread's masks too. Checked in a child process first, so that a crash fails this test only."""
    grammar = chained_rules(3000)
    child = subprocess.run(
        [sys.executable, "-c", CHAIN_SCRIPT, str(model_dir), grammar], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.split() == ["1"]  # only "y" is allowed
    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 4, "structured_outputs": {"grammar": grammar}}}
    r = httpx.post(f"{hostile_server.url}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert_serving(hostile_server)


VLLM_LIKE_COMPILE = """
import sys
import llguidance
from prime_inference.structured import deepen_main_stack
if sys.argv[2] == "deepened":
    deepen_main_stack()
# as vLLM's guidance backend validates a request's grammar: on the calling thread, here the main one
llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", sys.argv[1]))
print("compiled")
"""


def test_the_inference_process_compiles_deep_grammars_on_its_main_thread():
    """vLLM compiles a request's grammar itself, on the server's event loop (the main thread) and in its engine core:
    a grammar of 3000 chained rules segfaulted the vLLM server (one H200), which `serve` now prevents by raising its
    stack limit before vLLM starts. The deepest chain under the size bound compiles on a main thread so raised, and
    overflows one that is not."""
    grammar = chained_rules(10_000)
    assert len(grammar) < MAX_GRAMMAR_CHARS

    def compile_in_child(how: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", VLLM_LIKE_COMPILE, grammar, how]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    deepened = compile_in_child("deepened")
    assert deepened.returncode == 0 and deepened.stdout.split() == ["compiled"], deepened.stderr[-2000:]
    assert compile_in_child("as started").returncode == -11  # SIGSEGV: what took the vLLM server down


# ---------------------------------------------------------------- connections


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (after whatever answer it sends first)."""
    sock.settimeout(within)
    try:
        while sock.recv(1024):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_idle_slow_and_half_sent_connections_are_closed(hostile_server):
    host, port = "127.0.0.1", hostile_server.config.server.port
    idle = socket.create_connection((host, port))
    half_body = socket.create_connection((host, port))
    half_body.sendall(b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"token_ids"')
    slowloris = socket.create_connection((host, port))
    slowloris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    closed_at = None
    while time.monotonic() - start < KEEP_ALIVE + 8:
        try:  # a header line every 0.2 s: each byte restarted uvicorn's only timer, so this held a connection forever
            slowloris.sendall(b"X-Slow: 1\r\n")
        except OSError:
            closed_at = time.monotonic() - start
            break
        time.sleep(0.2)
    assert closed_at is not None and closed_at < KEEP_ALIVE + 5
    assert _closed_by_server(idle, 3) and _closed_by_server(half_body, 3)
    for s in (idle, half_body, slowloris):
        s.close()
    assert_serving(hostile_server)


def test_a_client_that_leaves_cancels_its_generation(hostile_server):
    """vLLM's ``with_cancellation``: a non-streaming request whose client disconnects is aborted, not run for nobody
    (an orchestrator that times out and retries would otherwise pile up work that holds every batch slot)."""
    url = hostile_server.url
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 100, "ignore_eos": True}}

    async def leave(n: int) -> None:
        async with httpx.AsyncClient() as client:

            async def one() -> None:
                with pytest.raises(httpx.TimeoutException):
                    await client.post(f"{url}/v1/generate", json=body, timeout=1.0)

            await asyncio.gather(*[one() for _ in range(n)])

    assert httpx.post(f"{url}/pause", timeout=10).status_code == 200
    try:
        asyncio.run(leave(8))  # held by the pause until their clients give up
        time.sleep(0.5)
    finally:
        httpx.post(f"{url}/resume", timeout=10)
    steps = health(hostile_server)["engine_steps"]
    time.sleep(1.0)
    after = health(hostile_server)
    assert after["running"] == after["waiting"] == 0
    assert after["engine_steps"] - steps < 5  # the 8 x 100 tokens nobody waits for are not generated
    assert_serving(hostile_server)


# ---------------------------------------------------------------- log flood


def test_malformed_requests_write_a_line_a_minute_not_one_each(hostile_server, caplog):
    """Each malformed request was a warning line in the server's log: a client connecting in a loop writes the log's
    disk full over a long run. Now one line a minute, counting those left out."""
    import logging

    from prime_inference.connections import ClientWarningsPerMinute

    uvicorn_log = logging.getLogger("uvicorn.error")
    clock = [0.0]
    limit = ClientWarningsPerMinute(clock=lambda: clock[0])
    uvicorn_log.addFilter(limit)
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            for _ in range(50):
                with socket.create_connection(("127.0.0.1", hostile_server.config.server.port), timeout=5) as s:
                    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                    s.recv(1024)  # uvicorn's 400: the warning is logged by then
            clock[0] = 61.0
            with socket.create_connection(("127.0.0.1", hostile_server.config.server.port), timeout=5) as s:
                s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                s.recv(1024)
    finally:
        uvicorn_log.removeFilter(limit)
    lines = [r.getMessage() for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
    assert lines == ["Invalid HTTP request received.", "Invalid HTTP request received. (49 more in the last 60 s)"]
    assert_serving(hostile_server)
