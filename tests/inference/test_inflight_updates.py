"""In-flight weight updates on the torch engine: a request that spans an update keeps going on the new weights, each
token carries the log-prob and weight step of the weights that sampled it, and the server's version ledger records
the range a tagged rollout spans (and aborts a stale one).

The engine is held after a few steps until the update is pending or done (``gate``), so the swap lands mid-request at a
known step boundary whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from .helpers import start_server

PROMPT = [12, 40, 7, 99, 3, 250, 17]
MAX_TOKENS = 40


def gate(engine, hold_after: int, release) -> None:
    """After ``hold_after`` engine steps, hold the scheduler thread until ``release()`` is true (at most 60 s)."""
    step, count = engine._step, [0]

    def gated(admitted):
        step(admitted)
        count[0] += 1
        if count[0] == hold_after:
            deadline = time.time() + 60
            while not release() and time.time() < deadline:
                time.sleep(0.005)

    engine._step = gated


def config(model_dir: Path, mode: str, **overrides):
    from prime_core.config.inference import InferenceConfig

    return InferenceConfig.model_validate(
        {"model": {"name": str(model_dir), "dtype": "float32"}, "engine": "torch", "max_model_len": 128,
         "weight_update": mode, "log": {"file": False}, **overrides}
    )  # fmt: skip


@pytest.fixture(scope="module")
def head_only_dir(tmp_path_factory, model_dir, tokenizer) -> Path:
    """The base model with another LM head only: the same keys and values at every position, so a kept KV cache is
    exactly what this model computes, and its log-probs of tokens after the swap are checkable against a forward."""
    from prime_core.io import mark_stable
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("weights") / "step_1"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight) * 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)
    return path


def reference_logprobs(model_dir: Path, completion: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT) :, None])[:, 0]


def span_update(model_dir: Path, new_dir: Path, mode: str) -> list:
    """Engine outputs of one sampled request, with an update to ``new_dir`` (step 1) issued after its 4th step."""
    from prime_inference.engines.base import EngineRequest
    from prime_inference.engines.torch_engine import TorchEngine
    from prime_inference.protocol import SamplingParams
    from transformers import AutoTokenizer

    engine = TorchEngine(config(model_dir, mode), AutoTokenizer.from_pretrained(model_dir))
    gate(engine, 4, lambda: engine._swap is not None or engine.weight_step == 1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)

    async def main() -> list:
        await engine.start()
        try:
            update = None
            outputs = []
            async for out in engine.generate(EngineRequest("r", PROMPT, params)):
                outputs.append(out)
                if update is None:
                    update = asyncio.create_task(engine.update_weights(str(new_dir), 1))
            await asyncio.wait_for(update, 60)
            return outputs
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_a_request_spanning_an_in_flight_update_carries_both_versions_logprobs(model_dir, head_only_dir):
    outputs = span_update(model_dir, head_only_dir, "in_flight")
    tokens = [t for o in outputs for t in o.token_ids]
    steps = [o.weight_step for o in outputs for _ in o.token_ids]
    served = torch.tensor([lp for o in outputs for lp in o.logprobs], dtype=torch.float64)
    n_old = steps.count(0)
    assert len(tokens) == MAX_TOKENS and 0 < n_old < MAX_TOKENS
    assert steps == [0] * n_old + [1] * (MAX_TOKENS - n_old)  # swapped at one step boundary, without draining
    old, new = reference_logprobs(model_dir, tokens), reference_logprobs(head_only_dir, tokens)
    assert torch.allclose(served[:n_old], old[:n_old], atol=1e-4)
    assert torch.allclose(served[n_old:], new[n_old:], atol=1e-4)
    assert not torch.allclose(old[n_old:], new[n_old:], atol=1e-2)  # the two versions do differ there


def test_in_flight_update_keeps_the_kv_cache_of_running_requests(model_dir, other_weights_dir):
    """All weights differ: the tokens after the swap attend to keys and values the old weights cached (kept, not
    recomputed), so their log-probs are the new weights' over that cache, not a fresh forward of the new model."""
    outputs = span_update(model_dir, other_weights_dir, "in_flight")
    tokens = [t for o in outputs for t in o.token_ids]
    n_old = sum(o.weight_step == 0 for o in outputs)
    served = torch.tensor([lp for o in outputs for lp in o.logprobs], dtype=torch.float64)
    recomputed = reference_logprobs(other_weights_dir, tokens)
    assert torch.allclose(served[:n_old], reference_logprobs(model_dir, tokens)[:n_old], atol=1e-4)
    assert not torch.allclose(served[n_old:], recomputed[n_old:], atol=1e-3)


def test_drain_finishes_running_requests_on_the_old_weights(model_dir, head_only_dir):
    outputs = span_update(model_dir, head_only_dir, "drain")
    assert len(outputs) == MAX_TOKENS and {o.weight_step for o in outputs} == {0}


def tagged(url: str, tag: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "seed": 1,
            "logprobs": 1, "extra_args": {"prime_rollout": tag}}}  # fmt: skip
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)


def versions(url: str, tags: list[str], **flags) -> dict:
    r = httpx.post(f"{url}/rollout_versions", json={"tags": tags, **flags}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def gated_server(model_dir, release):
    """A server updating in flight whose engine holds its 4th step until ``release(engine)`` is true; its engines."""
    from prime_inference.engines import build_engine

    cfg, engines = config(model_dir, "in_flight"), []

    def factory():
        engine, tokenizer = build_engine(cfg)
        gate(engine, 4, lambda: release(engine))
        engines.append(engine)
        return engine, tokenizer

    return start_server(model_dir, weight_update="in_flight", engine_factory=factory), engines


def held_request(server, engines, tag: str, done: dict) -> threading.Thread:
    """``tag``'s request in a thread (its answer goes to ``done["r"]``), once the engine holds it at its 4th step."""
    worker = threading.Thread(target=lambda: done.update(r=tagged(server.url, tag)))
    worker.start()
    deadline = time.monotonic() + 60
    while engines[0].num_steps < 4:
        assert time.monotonic() < deadline, f"the engine made no 4 steps of {tag!r} in 60 s"
        time.sleep(0.01)
    return worker


def test_the_server_records_the_versions_a_tagged_rollout_spans_and_aborts_stale_ones(model_dir, head_only_dir):
    release = threading.Event()
    server, engines = gated_server(model_dir, lambda e: e._swap is not None or e.weight_step == 1 or release.is_set())
    try:
        done: dict = {}
        worker = held_request(server, engines, "rollout-1", done)
        live = versions(server.url, ["rollout-1", "unknown"])["versions"]  # read while it runs: the first token's
        assert set(live) == {"rollout-1"} and live["rollout-1"]["first"] == 0 and live["rollout-1"]["exact"]
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(head_only_dir), "step": 1}, timeout=60)
        assert r.status_code == 200, r.text
        worker.join(60)
        assert done["r"].status_code == 200 and len(done["r"].json()["choices"][0]["token_ids"]) == MAX_TOKENS
        got = versions(server.url, ["rollout-1"], pop=True)["versions"]["rollout-1"]
        assert (got["first"], got["last"], got["num_tokens"], got["exact"]) == (0, 1, MAX_TOKENS, True)
        assert versions(server.url, ["rollout-1"])["versions"] == {}  # popped

        # A second turn of another rollout, held mid-request, aborted by its tag: it answers 409 and stops.
        # The gate holds only once: hold the next request by pausing.
        httpx.post(f"{server.url}/pause", timeout=10)
        worker = threading.Thread(target=lambda: done.update(r=tagged(server.url, "rollout-2")))
        worker.start()
        deadline = time.time() + 30
        while engines[0].info.waiting == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert versions(server.url, ["rollout-2"], abort=True)["aborted"] == 1
        worker.join(30)
        assert done["r"].status_code == 409 and "aborted" in done["r"].json()["error"]["message"]
        httpx.post(f"{server.url}/resume", timeout=10)
    finally:
        release.set()
        server.stop()


def corrupt(base: Path, dest: Path, how: str) -> Path:
    """A copy of ``base`` marked STABLE whose safetensors are broken in one way."""
    import shutil

    from prime_core.io import mark_stable
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dest)
    (dest / "STABLE").unlink(missing_ok=True)
    file = next(dest.glob("*.safetensors"))
    if how == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        state = load_file(file)
        name = next(k for k in state if k.endswith("mlp.up_proj.weight"))
        if how == "nan":
            state[name] = torch.full_like(state[name], float("nan"))
        elif how == "garbage":  # finite (random bytes in a file): passes the load's check, overflows in a forward
            state[name] = torch.full_like(state[name], 3e38)
        elif how == "wrong_shape":
            state[name] = state[name][:-1].clone()
        elif how == "missing_tensor":
            del state[name]
        save_file(state, file, metadata={"format": "pt"})
    mark_stable(dest)
    return dest


FAULTS = {
    "truncated": "unreadable safetensors",
    "nan": "mlp.up_proj.weight holds NaN or infinite values",
    "wrong_shape": "size mismatch for model.layers.0.mlp.up_proj.weight",
    "missing_tensor": "missing=['model.layers.0.mlp.up_proj.weight']",
}


def test_a_failed_in_flight_update_keeps_serving_and_reporting_the_old_weights(model_dir, head_only_dir, tmp_path):
    """Each broken step directory is refused with a one-line 400 naming why (a truncated file answered a reasonless
    500 that clients retried; NaN weights were served, every token then 0, while /health reported the new step; a
    missing tensor was blamed on the model class). A request running across the failures samples every token on
    the old weights, its record says so, and a good update afterwards still lands."""
    release = threading.Event()
    server, engines = gated_server(model_dir, lambda e: release.is_set())
    try:
        done: dict = {}
        worker = held_request(server, engines, "spans-failures", done)
        for step, (how, reason) in enumerate(FAULTS.items(), start=1):
            broken = corrupt(head_only_dir, tmp_path / f"step_{step}", how)
            t0 = time.monotonic()
            r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(broken), "step": step}, timeout=60)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and reason in message and str(broken) in message, (how, r.text)
            assert time.monotonic() - t0 < 30
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            assert (health["weight_step"], health["weight_dir"]) == (0, None), how
        release.set()
        worker.join(60)
        assert done["r"].status_code == 200 and len(done["r"].json()["choices"][0]["token_ids"]) == MAX_TOKENS
        got = versions(server.url, ["spans-failures"], pop=True)["versions"]["spans-failures"]
        assert (got["first"], got["last"], got["num_tokens"]) == (0, 0, MAX_TOKENS)
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(head_only_dir), "step": 9}, timeout=60)
        assert r.status_code == 200 and r.json()["weight_step"] == 9
        assert httpx.get(f"{server.url}/health", timeout=10).json()["weight_step"] == 9
    finally:
        release.set()
        server.stop()


def test_weights_that_give_nan_logits_are_named_by_each_request(model_dir, head_only_dir, tmp_path):
    """benchmarks/chaos.py wrote random bytes into a weights file: finite, so the update took them, then every request
    answered `500 internal error: RuntimeError` (torch's multinomial on NaN probabilities) and the run ended on failed
    rollouts that named nothing; at temperature 0 a NaN's token was sampled silently. Each request now says why."""
    server = start_server(model_dir)
    try:
        broken = corrupt(head_only_dir, tmp_path / "step_1", "garbage")
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(broken), "step": 1}, timeout=60)
        assert r.status_code == 200, r.text
        for temperature in (1.0, 0.0):
            body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": temperature}}
            r = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60)
            assert r.status_code == 500 and "the model's logits are NaN or infinite" in r.json()["error"]["message"], (
                temperature,
                r.text,
            )
    finally:
        server.stop()
