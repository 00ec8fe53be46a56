"""LoRA adapters on the torch engine: a request naming an adapter is served exactly like the merged model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from .helpers import save_model, start_server

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [40, 41]]
NEW_TOKENS = 10


def _make_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A PEFT adapter on ``base_dir`` with random, output-changing A and B (rank 4)."""
    from prime_models import load_model
    from prime_models import lora as L

    model = load_model(base_dir)
    L.apply_lora(model, L.LoRASpec(rank=4, alpha=8.0), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in L.adapter_parameters(model, "default"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    L.save_adapter(model, "default", out)
    return out


def _publish(adapter_dir: Path, out: Path, name: str, step: int) -> Path:
    """What the trainer writes to ``weights/step_N`` of a LoRA run."""
    import shutil

    from prime_core.io import mark_stable
    from prime_core.schemas.adapters import ADAPTER_INFO

    shutil.copytree(adapter_dir, out)
    (out / ADAPTER_INFO).write_text(json.dumps({"name": name, "step": step}))
    mark_stable(out)
    return out


def _reference_greedy(base_dir: Path, adapter_dir: Path | None) -> list[list[int]]:
    """Greedy continuations of a merged model (base + scale * B @ A), by full forwards without a KV cache."""
    from prime_models import load_model
    from prime_models import lora as L

    model = load_model(base_dir).eval()
    if adapter_dir is not None:
        L.load_adapter(model, "x", adapter_dir)
        L.merge_adapter(model, "x")
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    return outs


def _greedy(url: str, prompt: list[int], model: str | None = None) -> httpx.Response:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/generate", json=body, timeout=60)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lora")
    base = save_model(root / "base", tokenizer, seed=0)
    other_base = save_model(root / "other_base", tokenizer, seed=1)
    a1 = _make_adapter(base, root / "adapter1", seed=1)
    a2 = _make_adapter(base, root / "adapter2", seed=2)
    refs = {
        "base": _reference_greedy(base, None),
        "a1": _reference_greedy(base, a1),
        "a2": _reference_greedy(base, a2),
        "other+a2": _reference_greedy(other_base, a2),
    }
    server = start_server(base)
    yield server, root, refs
    server.stop()


def test_adapter_requests_equal_merged_model_and_base_stays_base(lora_setup):
    server, root, refs = lora_setup
    assert refs["a1"] != refs["base"]  # the adapter really changes the output
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "tenant-a", "lora_path": str(root / "adapter1")}
    )
    assert r.status_code == 200, r.text
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert ids[1:] == ["tenant-a"]

    # A mixed running batch: adapter and base requests decode together.
    async def run_all():
        async with httpx.AsyncClient(timeout=60) as client:
            reqs = []
            for prompt in PROMPTS:
                for model in ("tenant-a", None):
                    body = {"token_ids": prompt, "model": model,
                            "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
                    reqs.append(client.post(f"{server.url}/v1/generate", json=body))
            return await asyncio.gather(*reqs)

    responses = asyncio.run(run_all())
    got = [r.json()["choices"][0]["token_ids"] for r in responses]
    assert got[0::2] == refs["a1"]
    assert got[1::2] == refs["base"]
    assert responses[0].json()["model"] == "tenant-a"

    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tenant-a", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
    })  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == "tenant-a"


def test_update_weights_with_published_adapter_replaces_it(lora_setup):
    server, root, refs = lora_setup
    published = _publish(root / "adapter2", root / "run" / "weights" / "step_3", "tenant-a", 3)
    r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(published)})
    assert r.status_code == 200, r.text
    assert r.json()["lora_name"] == "tenant-a" and r.json()["weight_step"] == 3
    assert [_greedy(server.url, p, "tenant-a").json()["choices"][0]["token_ids"] for p in PROMPTS] == refs["a2"]
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["tenant-a"]["weight_step"] == 3 and cards["tenant-a"]["root"] == str(published)
    # The base model itself is untouched.
    assert [_greedy(server.url, p).json()["choices"][0]["token_ids"] for p in PROMPTS] == refs["base"]


def test_new_base_weights_keep_serving_the_adapter(lora_setup, tmp_path, tokenizer):
    server, root, refs = lora_setup
    # Self-contained (xdist may run this test apart from the others of the module): tenant-a serves adapter2.
    published = _publish(root / "adapter2", tmp_path / "weights" / "step_3", "tenant-a", 3)
    httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(published)}).raise_for_status()
    other = root / "other_base"
    r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other), "step": 4})
    assert r.status_code == 200, r.text
    assert [_greedy(server.url, p, "tenant-a").json()["choices"][0]["token_ids"] for p in PROMPTS] == refs["other+a2"]
    httpx.post(f"{server.url}/reload_weights").raise_for_status()


def test_adapter_errors_and_unload(lora_setup, tmp_path):
    server, root, _ = lora_setup
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    rel = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "adapter1"})
    assert rel.status_code == 400
    name = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad name", "lora_path": str(tmp_path)})
    assert name.status_code == 400
    # An adapter dir without prime_adapter.json cannot be relayed by /update_weights (no name).
    from prime_core.io import mark_stable

    mark_stable(root / "adapter1")
    anon = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(root / "adapter1")})
    assert anon.status_code == 400 and "load_lora_adapter" in anon.json()["error"]["message"]
    assert _greedy(server.url, PROMPTS[0], "nope").status_code == 404

    # Self-contained (xdist may run this test apart from the others of the module): load, then unload.
    r = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "tenant-a", "lora_path": str(root / "adapter1")}
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "tenant-a"})
    assert r.status_code == 200, r.text
    assert _greedy(server.url, PROMPTS[0], "tenant-a").status_code == 404
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "tenant-a"}).status_code == 404


def test_a_changed_adapter_file_is_refused_and_not_loaded(lora_setup, tmp_path):
    """``/v1/load_lora_adapter`` checks the adapter's ``checksums.json`` as ``/update_weights`` checks a step: a file
    whose bytes changed (or a sum file that is garbage) is a 400 in one line, and no adapter of that name is served."""
    import shutil

    from prime_core.io import file_crc32
    from prime_core.schemas.weights import CHECKSUMS_FILE, write_checksums

    server, root, _ = lora_setup
    adapter = shutil.copytree(root / "adapter1", tmp_path / "adapter")
    written = write_checksums(adapter, {})["adapter_model.safetensors"]
    file = adapter / "adapter_model.safetensors"
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
    body = {"lora_name": "changed", "lora_path": str(adapter), "step": 7}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert (r.status_code, r.json()["error"]["message"]) == (
        400,
        f"weights step 7: {file}: its bytes changed after the trainer wrote it (CRC-32 {file_crc32(file)}, written "
        f"as {written})",
    )
    (adapter / CHECKSUMS_FILE).write_text('{"adapter_model.safetensors": ')  # cut short
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"weights step 7: {adapter / CHECKSUMS_FILE} is unreadable ("
    ), r.text
    assert "changed" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert _greedy(server.url, PROMPTS[0], "changed").status_code == 404


def test_lora_serving_config():
    from prime_core.config.inference import InferenceConfig
    from prime_inference.engines.vllm_engine import vllm_cli_args
    from pydantic import ValidationError

    cfg = InferenceConfig.model_validate({"model": {"name": "m", "lora": {"rank": 24}}})
    assert cfg.lora_enabled and cfg.max_lora_rank == 32
    args = vllm_cli_args(cfg)
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "32"
    assert args[args.index("--max-loras") + 1] == "8"
    assert "--enable-lora" not in vllm_cli_args(InferenceConfig.model_validate({"model": {"name": "m"}}))
    with pytest.raises(ValidationError, match="max_lora_rank"):
        InferenceConfig.model_validate({"lora": {"max_lora_rank": 12}})
    with pytest.raises(ValidationError, match="below model.lora.rank"):
        InferenceConfig.model_validate({"model": {"lora": {"rank": 64}}, "lora": {"max_lora_rank": 32}})
