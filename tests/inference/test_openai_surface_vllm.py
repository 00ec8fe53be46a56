"""The OpenAI surface on the vLLM engine (GPU): vLLM's own routes with our flags, the same client cases as the torch
engine's (tests/inference/surface_cases.py), plus prime's token-in and admin routes in front of vLLM's."""

from __future__ import annotations

import importlib.util
import json
import os

import httpx
import pytest

from . import surface_cases as cases
from .helpers import inference_server, start_server
from .surface import build_surface_tokenizer, save_surface_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed"),
]


def surface_server(tmp_path_factory, structured_outputs_config: str):
    model_dir = save_surface_model(tmp_path_factory.mktemp("surface") / "model")
    settings = {
        "max_model_len": 1024,
        "server": {"served_model_name": "m"},
        "enable_auto_tool_choice": True,
        "tool_call_parser": "hermes",
        "reasoning_parser": "qwen3",
        # bf16 as served: vLLM 0.26's V2 model runner hits an illegal memory access warming up an fp32 model (H100).
        "model": {"name": str(model_dir), "dtype": "bfloat16"},
        "vllm": {
            "gpu_memory_utilization": 0.3,
            "enforce_eager": True,
            # Grammars also bind inside <think>, so a forced think block is possible (vLLM skips them there).
            # vLLM 0.26 takes disable_any_whitespace from here only (a request's own field is ignored), and only with
            # a named backend; guidance (llguidance) is the one that takes token references in Lark grammars.
            "extra_args": ["--structured-outputs-config", structured_outputs_config],
        },
    }
    # A host's own engine settings as JSON, e.g. '{"model": {"dtype": "bfloat16"}}'; dict-valued keys merge.
    for key, value in json.loads(os.environ.get("PRIME_TEST_VLLM_OVERRIDES") or "{}").items():
        settings[key] = {**settings[key], **value} if isinstance(value, dict) else value
    server = start_server(model_dir, engine="vllm", startup_timeout=600, **settings)
    server.tokenizer = build_surface_tokenizer()
    return server


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    server = surface_server(
        tmp_path_factory, '{"backend": "guidance", "enable_in_reasoning": true, "disable_any_whitespace": true}'
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server_default_backend(tmp_path_factory):
    # xgrammar is what vLLM's "auto" picks; named here only because disable_any_whitespace needs a named backend.
    server = surface_server(tmp_path_factory, '{"backend": "xgrammar", "disable_any_whitespace": true}')
    yield server
    server.stop()


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_vllm_forced_tool_call_and_reasoning(vllm_server):
    cases.check_forced_tool_call_and_reasoning(client(vllm_server), "m", vllm_server.tokenizer)


def test_vllm_structured_outputs(vllm_server):
    # vLLM 0.26's qwen3 parser engine decodes a delta token by token once it holds a marker token, EOS included
    # (vllm/parser/engine/token_id_scanner.py), so a grammar-ended answer may end in "<|im_end|>" (seen on an H100).
    cases.check_structured_outputs(client(vllm_server), "m", eos_text="<|im_end|>")


def test_vllm_named_tool_choice(vllm_server_default_backend):
    # On vLLM's default backend (xgrammar): vLLM 0.26 builds a named or required tool choice as one of xgrammar's
    # structural tags, which its guidance backend cannot read (KeyError 'triggers', a 500 from `vllm serve` too).
    cases.check_named_tool_choice(client(vllm_server_default_backend), "m")


def test_vllm_engine_errors_are_vllms_500(vllm_server):
    """An error inside vLLM's engine call is vLLM's own 500 and the server keeps serving (its error handler looks up
    the HTTP server on the app's state, as `vllm serve` sets it)."""
    from openai import InternalServerError

    named = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(InternalServerError) as failed:
        client(vllm_server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=cases.TOOLS, tool_choice=named, max_tokens=4
        )
    assert "State" not in str(failed.value)
    assert httpx.get(f"{vllm_server.url}/health").json()["status"] == "ok"


def test_vllm_sampling_parameters_and_tolerant_requests(vllm_server):
    cases.check_sampling_parameters(client(vllm_server), "m", vllm_server.url)
    cases.check_tolerant_requests(client(vllm_server), "m")
    cases.check_token_in_sampling_fields(vllm_server.url, vllm_server.tokenizer)


def test_vllm_tokenize_routes(vllm_server):
    cases.check_tokenize_routes(vllm_server.url, "m")


def test_vllm_prime_routes_in_front_of_vllms(vllm_server):
    url = vllm_server.url
    health = httpx.get(f"{url}/health").json()  # prime's /health, not vLLM's empty 200
    assert health["engine"] == "vllm" and health["weight_step"] == 0
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["X-Weight-Step"] == "0"
    assert len(r.json()["choices"][0]["token_ids"]) == 4 and "prompt_token_ids" in r.json()
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}, timeout=120)  # fmt: skip
    assert chat.status_code == 200 and chat.headers["X-Weight-Step"] == "0"
    assert httpx.post(f"{url}/pause").json() == {"status": "paused"}
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}


def test_vllm_forced_tool_calls(vllm_server_default_backend):
    # xgrammar: vLLM 0.26 builds forced tool choices as structural tags, which its guidance backend cannot read.
    cases.check_forced_tool_calls(client(vllm_server_default_backend), "m")


def test_vllm_reasoning_echo_log_probs_and_refusals(vllm_server):
    """The cases the torch engine was measured against (issue #40), on vLLM itself."""
    cases.check_reasoning_without_think_block(client(vllm_server), "m", vllm_server.tokenizer)
    cases.check_echo(client(vllm_server), "m", vllm_server.tokenizer)
    cases.check_raw_logprobs_by_default(vllm_server.url, "m")
    cases.check_unknown_field_ignored(vllm_server.url, "m")
    cases.check_refused_requests(vllm_server.url, "m", stop_limit=None)  # vLLM 0.26 takes any number of stops


def test_vllm_deeply_chained_grammar_leaves_the_server_serving(tmp_path):
    """A grammar of 3000 chained rules (48 kB, under the server's size bound) is compiled again by vLLM, with
    llguidance, on the server's event loop: on an 8 MB stack the segfault took the server down (one H200, vLLM 0.26,
    a server in a test thread). The `inference` process raises its stack limit first; it answers, and goes on
    serving. A process of its own, as users run it: a crash fails this test, not the session."""
    from .test_hostile_clients import chained_rules

    model_dir = save_surface_model(tmp_path / "model")
    with inference_server(model_dir, "vllm", tmp_path) as url:
        body = {
            "token_ids": [5, 6],
            "sampling_params": {"max_tokens": 4, "structured_outputs": {"grammar": chained_rules(3000)}},
        }
        r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text[:300]
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        plain = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}
        assert httpx.post(f"{url}/inference/v1/generate", json=plain, timeout=60).status_code == 200
