"""The vLLM engine: import-level checks on CPU, real serving on a GPU (marker `gpu`)."""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest
from prime_core.config.inference import InferenceConfig

from .helpers import start_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_plugin_module_imports_without_vllm_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, prime_inference.vllm_plugin as p\np.register(); p.register()\n"
        "assert p.plugin_registered()\n"
        "assert p.PrimeWorkerExtension().prime_plugin_status()['general_plugin']\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("prime") == "prime_inference.vllm_plugin:register"


def test_vllm_cli_args_pass_options_through():
    from prime_inference.engines.vllm_engine import WORKER_EXTENSION_CLS, vllm_cli_args

    config = InferenceConfig.model_validate(
        {"model": {"name": "m"}, "max_model_len": 4096,
         "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 4, "data_parallel_size_local": 2,
                  "data_parallel_address": "10.0.0.1", "enforce_eager": True, "extra_args": ["--kv-cache-dtype", "fp8"]}}
    )  # fmt: skip
    args = vllm_cli_args(config, headless=True)
    joined = " ".join(args)
    for part in ("--model m", "--tensor-parallel-size 2", "--data-parallel-size 4", "--data-parallel-size-local 2",
                 "--data-parallel-address 10.0.0.1", "--enforce-eager", "--max-model-len 4096", "--headless",
                 f"--worker-extension-cls {WORKER_EXTENSION_CLS}", "--logprobs-mode raw_logprobs"):  # fmt: skip
        assert part in joined
    assert args[-2:] == ["--kv-cache-dtype", "fp8"]
    assert "--disable-log-stats" in args  # vLLM's per-step statistics cost rollout throughput (vllm.log_stats)
    with_stats = config.model_copy(update={"vllm": config.vllm.model_copy(update={"log_stats": True})})
    assert "--disable-log-stats" not in vllm_cli_args(with_stats)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_engine_args_parse_with_vllms_parser(model_dir):
    from prime_inference.engines.vllm_engine import engine_args

    # A local directory: vLLM resolves a hub id over the network while parsing.
    config = InferenceConfig.model_validate(
        {"model": {"name": str(model_dir)}, "vllm": {"extra_args": ["--max-num-batched-tokens", "4096"]}}
    )
    args = engine_args(config)
    assert args.max_num_batched_tokens == 4096
    assert args.worker_extension_cls == "prime_inference.vllm_plugin.PrimeWorkerExtension"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_serves_updates_and_reloads(model_dir, other_weights_dir):
    server = start_server(
        model_dir,
        engine="vllm",
        # bf16 as served: vLLM 0.26's V2 model runner hits an illegal memory access warming up an fp32 model (H100).
        model={"name": str(model_dir), "dtype": "bfloat16"},
        vllm={"gpu_memory_utilization": 0.3, "enforce_eager": True},
        startup_timeout=600,
    )
    try:
        health = httpx.get(f"{server.url}/health").json()
        assert health["engine"] == "vllm" and health["vllm_plugin"]["loaded"]
        body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 0}}
        base = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        r = httpx.post(
            f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 1}, timeout=600
        )
        assert r.status_code == 200, r.text
        updated = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        assert updated["token_ids"] != base["token_ids"]
        assert httpx.post(f"{server.url}/reload_weights", timeout=600).status_code == 200
        again = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        assert again["token_ids"] == base["token_ids"]
        start = time.perf_counter()
        assert httpx.post(f"{server.url}/pause").json() == {"status": "paused"}
        assert httpx.post(f"{server.url}/resume").json() == {"status": "resumed"}
        assert time.perf_counter() - start < 30
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_fast_token_logprobs_equal_vllms_own(model_dir):
    """vllm.fast_token_logprobs: the tapped values (``logprobs`` 0, and 1 as renderers' client asks) equal what vLLM
    returns for the same seeded request through its own path (``logprobs: 2``: the sampled token's entry), alone and
    in a full batch."""
    import asyncio

    server = start_server(
        model_dir,
        engine="vllm",
        model={"name": str(model_dir), "dtype": "bfloat16"},
        vllm={"gpu_memory_utilization": 0.3, "enforce_eager": True, "fast_token_logprobs": True},
        startup_timeout=600,
    )

    def body(seed: int, k: int) -> dict:
        sp = {"max_tokens": 24, "temperature": 1.0, "seed": seed, "logprobs": k, "ignore_eos": True}
        return {"token_ids": [5, 6, 7, 8 + seed % 50], "sampling_params": sp}

    async def burst(bodies: list[dict]) -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            posts = [client.post(f"{server.url}/inference/v1/generate", json=b) for b in bodies]
            return [r.json()["choices"][0] for r in await asyncio.gather(*posts)]

    try:
        assert httpx.get(f"{server.url}/health").json()["fast_token_logprobs"]
        for seed in range(3):  # one at a time: the same batch for each, so the same tokens and values
            own = asyncio.run(burst([body(seed, 2)]))[0]
            expected = [c["logprob"] for c in own["logprobs"]["content"]]
            for k in (0, 1):
                tapped = asyncio.run(burst([body(seed, k)]))[0]
                assert tapped["token_ids"] == own["token_ids"]
                assert [c["logprob"] for c in tapped["logprobs"]["content"]] == pytest.approx(expected, abs=1e-5)
                assert all(len(c["top_logprobs"]) == 1 for c in tapped["logprobs"]["content"])
        # A full batch, tapped requests mixed with requests that keep vLLM's tensors in the same steps.
        choices = asyncio.run(burst([body(seed, seed % 3) for seed in range(64)]))
        for c in choices:
            assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 24
            assert all(-50 < e["logprob"] <= 0 for e in c["logprobs"]["content"])
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_teacher_scores_prompts_and_stays_frozen(model_dir):
    """A distillation teacher on vLLM (what rl starts from [teacher] on GPUs): prompt log-probs on the token-in route
    (max_tokens 1, prompt_logprobs 0) close to the torch engine's on the same weights, and no weight change."""
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}}
    scores = {}
    for engine, extra in (("torch", {}), ("vllm", {"vllm": {"gpu_memory_utilization": 0.3, "enforce_eager": True}})):
        server = start_server(model_dir, engine=engine, model={"name": str(model_dir), "dtype": "bfloat16"},
                              server={"frozen": True}, startup_timeout=600, **extra)  # fmt: skip
        try:
            out = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()
            entries = out["prompt_logprobs"]
            assert len(entries) == len(ids) and entries[0] is None
            scores[engine] = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)]
            assert httpx.post(f"{server.url}/reload_weights", timeout=60).status_code == 403
        finally:
            server.stop()
    assert scores["vllm"] == pytest.approx(scores["torch"], abs=0.05)  # bf16 on both, different kernels
