"""The HTTP surface on the torch engine: OpenAI client, token-in generate, weight updates, pause, batching."""

from __future__ import annotations

import asyncio
import time

import httpx
import torch

from tests.inference.helpers import start_server


def generate(url: str, token_ids: list[int], **sampling) -> dict:
    r = httpx.post(f"{url}/v1/generate", json={"token_ids": token_ids, "sampling_params": sampling}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(url: str, token_ids: list[int], max_tokens: int = 12) -> list[int]:
    return generate(url, token_ids, max_tokens=max_tokens, temperature=0.0)["choices"][0]["token_ids"]


def test_openai_client_chat_completion_and_streaming(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content) > 0
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3

    completion = client.completions.create(model=model, prompt="the quick brown", max_tokens=6, temperature=0)
    sampled = client.completions.create(model=model, prompt="the quick brown", max_tokens=6, n=2, seed=3)
    assert len(completion.choices) == 1 and len(sampled.choices) == 2

    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == chat.choices[0].message.content

    stream = client.completions.create(
        model=model, prompt="the quick brown", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_generate_matches_vllm_schema_and_default_max_tokens(server):
    body = generate(server.url, [5, 6, 7], logprobs=2, temperature=1.0, seed=1, max_tokens=4)
    assert set(body) >= {"request_id", "choices", "usage", "prompt_logprobs", "kv_transfer_params"}
    choice = body["choices"][0]
    assert set(choice) >= {"index", "token_ids", "logprobs", "finish_reason", "routed_experts"}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    # vLLM: no max_tokens means up to max_model_len, not 16.
    long = generate(server.url, [5, 6, 7], temperature=1.0, seed=2, ignore_eos=True)["choices"][0]
    assert len(long["token_ids"]) == 128 - 3 and long["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible_regardless_of_batching(server):
    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "token_ids": [9, 10, 11],
                "sampling_params": {"max_tokens": 10, "seed": 42, "top_k": 50, "top_p": 0.9},
            }
            noise = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 20}}
            rs = await asyncio.gather(*[client.post(f"{server.url}/v1/generate", json=b) for b in [body, noise] * 4])
            return [r.json()["choices"][0]["token_ids"] for r in rs[::2]]

    alone = generate(server.url, [9, 10, 11], max_tokens=10, seed=42, top_k=50, top_p=0.9)["choices"][0]["token_ids"]
    assert all(ids == alone for ids in asyncio.run(run()))


def test_stop_strings_and_stop_token_ids(server, tokenizer):
    ids = greedy(server.url, [5, 6, 7], max_tokens=12)
    stop_token = ids[3]
    out = generate(server.url, [5, 6, 7], max_tokens=12, temperature=0, stop_token_ids=[stop_token])["choices"][0]
    assert out["token_ids"] == ids[: ids.index(stop_token) + 1] and out["finish_reason"] == "stop"
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if stop.strip():
        r = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "stop": stop}
        )
        assert r.json()["choices"][0]["text"] == full[: full.find(stop)]
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_a_completion_prompt_of_token_ids_is_one_prompt_however_long(server):
    """``prompt: [ids]`` is one prompt (vLLM's reading): 100 token ids generate one choice whose prompt is all of them
    (before: a 400, "number of prompts times n must be at most 64"), and ``[[ids], [ids]]`` is two prompts."""
    ids = [5 + i % 50 for i in range(100)]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3 and r.json()["usage"]["prompt_tokens"] == len(ids)
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [ids[:70], ids[:5]]}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["prompt_tokens"] == 75


def test_generate_logprobs_equal_model_logprobs(server, model_dir):
    """Token-in log-probs equal the trainer model's (prime_models, else transformers) within 1e-4 in fp32."""
    try:
        from prime_models import load_model

        model = load_model(str(model_dir), dtype=torch.float32)
    except ImportError:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = [12, 40, 7, 99, 3, 250, 17]
    worst = 0.0
    for temperature in (1.0, 0.7):
        body = generate(server.url, prompt, max_tokens=24, temperature=temperature, seed=5, logprobs=0, ignore_eos=True)
        choice = body["choices"][0]
        served = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]], dtype=torch.float64)
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            out = model(ids, torch.arange(ids.shape[1])[None])
        logits = (out.logits if hasattr(out, "logits") else out)[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        worst = max(worst, float((served - ref).abs().max()))
    print(f"max |served - model| log-prob difference: {worst:.2e}")
    assert worst < 1e-4


def test_update_weights_changes_output_and_reload_restores(server, model_dir, other_weights_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8]
    base = greedy(server.url, prompt)
    r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["weight_step"] == 3
    assert httpx.get(f"{server.url}/health").json()["weight_step"] == 3
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["weight_step"] == 3
    updated = greedy(server.url, prompt)
    hf = AutoModelForCausalLM.from_pretrained(other_weights_dir, dtype=torch.float32)
    expected = hf.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=12, attention_mask=torch.ones(1, 4, dtype=torch.long)
    )
    assert updated != base
    assert updated == expected[0, len(prompt) :].tolist()

    unstable = tmp_path / "unstable"
    unstable.mkdir()
    r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(unstable)})
    assert r.status_code == 409 and "STABLE" in r.json()["error"]["message"]

    assert httpx.post(f"{server.url}/reload_weights", timeout=60).json() == {"status": "ok", "weight_step": 0}
    assert greedy(server.url, prompt) == base


def test_pause_holds_requests_until_resume(server):
    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            assert (await client.post(f"{server.url}/pause")).json() == {"status": "paused"}
            task = asyncio.ensure_future(
                client.post(
                    f"{server.url}/v1/generate", json={"token_ids": [3, 4], "sampling_params": {"max_tokens": 4}}
                )
            )
            await asyncio.sleep(0.5)
            assert not task.done()
            assert (await client.get(f"{server.url}/health")).json()["paused"] is True
            assert (await client.post(f"{server.url}/resume")).json() == {"status": "resumed"}
            assert (await client.post(f"{server.url}/resume")).json() == {"status": "resumed"}
            assert len((await task).json()["choices"][0]["token_ids"]) == 4

    asyncio.run(run())


def test_concurrent_requests_are_batched(server):
    body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 32, "ignore_eos": True, "temperature": 0.8}}
    num = 32

    async def run(concurrent: bool) -> float:
        async with httpx.AsyncClient(timeout=120) as client:
            start = time.perf_counter()
            if concurrent:
                rs = await asyncio.gather(*[client.post(f"{server.url}/v1/generate", json=body) for _ in range(num)])
            else:
                rs = [await client.post(f"{server.url}/v1/generate", json=body) for _ in range(num)]
            elapsed = time.perf_counter() - start
            assert all(len(r.json()["choices"][0]["token_ids"]) == 32 for r in rs)
            return elapsed

    sequential = asyncio.run(run(False))
    concurrent = asyncio.run(run(True))
    print(f"{num} requests x 32 tokens: sequential {sequential:.2f}s, concurrent {concurrent:.2f}s")
    assert concurrent < sequential


def test_frozen_server_refuses_every_weight_change(model_dir, other_weights_dir):
    """A distillation teacher (``server.frozen``, set by rl for the teacher it starts) keeps its weights: updates,
    reloads and adapters are refused with 403, and it still scores."""
    s = start_server(model_dir, server={"frozen": True})
    try:
        for route, body in (
            ("/update_weights", {"weight_dir": str(other_weights_dir)}),
            ("/reload_weights", {}),
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(other_weights_dir)}),
        ):
            r = httpx.post(f"{s.url}{route}", json=body, timeout=60)
            assert r.status_code == 403 and "frozen" in r.json()["error"]["message"], route
        assert httpx.get(f"{s.url}/health").json()["weight_step"] == 0
        body = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}
        assert len(httpx.post(f"{s.url}/inference/v1/generate", json=body, timeout=60).json()["prompt_logprobs"]) == 3
    finally:
        s.stop()
