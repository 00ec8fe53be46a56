"""Requests that are valid JSON and in range, yet cost the server far more than their answer is worth: id lists of
millions of repeats, detokenizing more tokens than any context holds, names megabytes long. Each is answered within
the bounds its route documents (or refused in one line naming the field), and the server goes on serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .helpers import start_server


@pytest.fixture(scope="module")
def server(model_dir):
    s = start_server(model_dir)
    yield s
    s.stop()


def engine(server):
    return server.server.config.app.state.prime.engine


def assert_serving(server) -> None:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}
    r = httpx.post(f"{server.url}/v1/generate", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["running"] == health["waiting"] == 0


def test_repeated_ids_reach_the_engine_once(server, monkeypatch):
    """``allowed_token_ids`` and ``stop_token_ids`` are sets to vLLM; each repeat made every sampled token of every
    one of ``n`` sequences slower in the engine thread, that all requests share: 5M copies of one id (15 MB) held
    the batch two minutes for 8 x 20 tokens, other clients' 2-token requests taking 7-18 s meanwhile."""
    seen = []
    generate = engine(server).generate

    def spy(request):
        seen.append((len(request.params.allowed_token_ids or []), len(request.params.stop_token_ids)))
        return generate(request)

    monkeypatch.setattr(engine(server), "generate", spy)
    sampling = {"max_tokens": 4, "n": 2, "allowed_token_ids": [5, 9] * 500_000, "stop_token_ids": [7] * 500_000}
    r = httpx.post(f"{server.url}/v1/generate", json={"token_ids": [5, 6], "sampling_params": sampling}, timeout=300)
    assert r.status_code == 200, r.text[:300]
    assert all(set(c["token_ids"]) <= {5, 9} for c in r.json()["choices"])
    assert seen == [(2, 1), (2, 1)]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "allowed_token_ids": [5] * 300_000}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and seen[-1] == (1, 0)
    assert_serving(server)


def test_detokenizing_more_than_a_context_is_refused(server):
    """``/detokenize`` decoded whatever it was given on the event loop: 5M tokens (15 MB) held every other client's
    answers 4.4 s. No sequence the model serves is longer than its context; the tokenize route is bounded alike."""
    max_len = server.config.max_model_len
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [5] * 1_000_000}, timeout=120)
    assert r.status_code == 400, r.text[:200]
    error = r.json()["error"]
    assert error["param"] == "tokens" and f"maximum context length of {max_len}" in error["message"]
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [5] * max_len}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"]
    assert_serving(server)


def test_one_requests_failure_in_the_engine_fails_it_alone(server, monkeypatch):
    """A request's own work in the engine thread (its prompt log-probs: a full forward of the prompt, out of memory
    on a long one) failing ended every running sequence: all clients' requests failed for one client's."""
    import torch
    from prime_inference.engines import torch_engine

    def out_of_memory(model, prompt_ids, k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 19.80 GiB")

    monkeypatch.setattr(torch_engine, "prompt_logprobs", out_of_memory)
    victim = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 20, "ignore_eos": True}}
    hostile = {"token_ids": [8, 9], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            assert (await client.post("/pause")).status_code == 200
            try:
                sent = [asyncio.ensure_future(client.post("/v1/generate", json=b)) for b in (victim, hostile)]
                while (await client.get("/health")).json()["waiting"] < 2:
                    await asyncio.sleep(0.05)
            finally:
                await client.post("/resume")  # both start in the same engine step
            return list(await asyncio.gather(*sent))

    ok, failed = asyncio.run(both())
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 20
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error: OutOfMemoryError"
    assert_serving(server)


def test_prompt_logprobs_are_computed_a_chunk_of_positions_at_a_time(monkeypatch):
    """The same values, with no prompt x vocabulary intermediate beyond one chunk's."""
    import torch
    from prime_inference.engines import sampling

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(50, 50, generator=torch.Generator().manual_seed(0)))

        def forward(self, ids):
            return self.table[ids]

    prompt = [i * 7 % 50 for i in range(40)]
    whole = sampling.prompt_logprobs(Logits(), prompt, 3)
    rows = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(sampling, "PROMPT_LOGPROBS_CHUNK", 6)
    monkeypatch.setattr(torch, "log_softmax", lambda x, dim: rows.append(len(x)) or log_softmax(x, dim=dim))
    assert sampling.prompt_logprobs(Logits(), prompt, 3) == whole
    assert max(rows) == 6 and sum(rows) == len(prompt) - 1


def test_an_adapter_name_no_load_accepts_is_refused_in_one_line(server):
    """Unloading a 1 MB name answered a 1 MB error (the name quoted back); no adapter of such a name can be loaded."""
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a" * 1_000_000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert len(r.content) < 1000
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "absent"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert_serving(server)


def _wait_for(predicate, what: str, bound_s: float = 30) -> None:
    import time

    deadline = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {bound_s} s"
        time.sleep(0.05)


def test_bodies_held_at_once_are_bounded_across_clients(server):
    """Each body was bounded (64 MiB), their sum was not: 8 clients sending 60 MB bodies raised the server's RSS by
    1 GB, and a few hundred sending slowly (each has ``timeout_keep_alive`` seconds) would hold tens of GB."""
    import socket

    budget = server.server.config.app.state.prime.body_budget
    assert budget.limit == server.config.server.max_buffered_body_bytes == 1024**3
    budget.limit = 300_000  # the two bodies below fill it
    senders = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", server.config.server.port))
            sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n" + b" " * 150_000)
            senders.append(sock)
        _wait_for(lambda: budget.held == 300_000, "both half-sent bodies held")
        body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}
        r = httpx.post(f"{server.url}/v1/generate", json=body, timeout=30)
        assert r.status_code == 503 and "server.max_buffered_body_bytes = 300000" in r.json()["error"]["message"]
    finally:
        for sock in senders:
            sock.close()
    _wait_for(lambda: budget.held == 0, "the bodies of the clients that left given back")
    budget.limit = server.config.server.max_buffered_body_bytes
    assert_serving(server)


def test_a_server_open_beyond_loopback_without_a_key_says_what_anyone_may_do(tmp_path):
    """Bound beyond loopback without ``server.api_key`` (as the multi-node SLURM template starts it), any host that
    reaches the port could pause the engine or reset the weights, and the log said nothing of it."""
    from prime_core.config.inference import InferenceConfig
    from prime_inference.entrypoints.inference import exposure_warning

    def config(**server) -> InferenceConfig:
        return InferenceConfig.model_validate({"server": {"weight_roots": [str(tmp_path)], **server}})

    assert config().server.host == "127.0.0.1" and exposure_warning(config()) is None
    assert exposure_warning(config(host="0.0.0.0", api_key="k")) is None
    line = exposure_warning(config(host="0.0.0.0", port=8123))
    assert line is not None and "\n" not in line
    assert all(word in line for word in ("server.api_key", "8123", "/pause", "/reload_weights"))


def test_min_tokens_past_max_tokens_is_refused_as_vllm_does(server):
    """vLLM's ``SamplingParams`` refuses it; the torch engine answered 200, ignoring ``min_tokens``."""
    for path, body in [
        ("/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3, "min_tokens": 100}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 4}),
    ]:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 400, (path, r.text[:200])
        assert r.json()["error"]["param"] == "min_tokens" and "max_tokens=3" in r.json()["error"]["message"]
    assert_serving(server)
