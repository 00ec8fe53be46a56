"""LoRA adapters on the vLLM engine (GPU): load, select per request, replace via /update_weights, unload."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from .helpers import save_model, start_server
from .test_lora_serving import PROMPTS, _greedy, _make_adapter, _publish, _reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")]


def test_vllm_serves_lora_adapters(tmp_path, tokenizer):
    base = save_model(tmp_path / "base", tokenizer, seed=0)
    a1, a2 = _make_adapter(base, tmp_path / "a1", seed=1), _make_adapter(base, tmp_path / "a2", seed=2)
    ref = {"base": _reference_greedy(base, None), "a1": _reference_greedy(base, a1), "a2": _reference_greedy(base, a2)}
    server = start_server(
        base,
        model={"name": str(base), "dtype": "bfloat16"},
        engine="vllm",
        lora={"enable": True, "max_lora_rank": 8, "max_loras": 2},
        vllm={"gpu_memory_utilization": 0.3, "enforce_eager": True},
        startup_timeout=600,
    )
    try:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(a1)}, timeout=120)
        assert r.status_code == 200, r.text
        got = [_greedy(server.url, p, "t").json()["choices"][0]["token_ids"] for p in PROMPTS]
        base_out = [_greedy(server.url, p).json()["choices"][0]["token_ids"] for p in PROMPTS]
        # bf16 serving vs an fp32 reference: compare the first tokens, before rounding can flip a near tie.
        assert [g[:3] for g in got] == [g[:3] for g in ref["a1"]]
        assert [g[:3] for g in base_out] == [g[:3] for g in ref["base"]]

        published = _publish(a2, tmp_path / "run" / "weights" / "step_2", "t", 2)
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(published)}, timeout=120)
        assert r.status_code == 200, r.text
        got2 = [_greedy(server.url, p, "t").json()["choices"][0]["token_ids"] for p in PROMPTS]
        assert [g[:3] for g in got2] == [g[:3] for g in ref["a2"]]
        assert {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]} >= {"t"}

        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "t"}).status_code == 200
        assert _greedy(server.url, PROMPTS[0], "t").status_code == 404
    finally:
        server.stop()
