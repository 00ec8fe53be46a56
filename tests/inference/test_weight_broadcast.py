"""Weights by broadcast (trainer rank 0 -> inference workers over gloo on CPU; NCCL on GPUs uses the same code)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from prime_core.config.trainer import WeightBroadcastConfig
from prime_core.io import atomic_dir
from prime_core.schemas.weights import BROADCAST_FILE, BroadcastManifest
from prime_models import load_model
from prime_trainer.weights.broadcast import BroadcastTimeout, WeightBroadcaster
from prime_trainer.world import World

from tests.inference.helpers import start_server
from tests.tiny import free_port

CPU_WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def greedy(url: str, prompt: list[int]) -> list[int]:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def announce(directory, manifest: BroadcastManifest):
    with atomic_dir(directory) as tmp:
        (tmp / BROADCAST_FILE).write_text(manifest.model_dump_json())
    return directory


def test_broadcast_update_serves_the_trainers_weights(tmp_path, model_dir, other_weights_dir):
    server = start_server(model_dir)
    try:
        prompt = [5, 6, 7, 8, 9]
        before = greedy(server.url, prompt)
        broadcaster = WeightBroadcaster(
            WeightBroadcastConfig(type="nccl", port=free_port(), timeout_s=60, bucket_mb=1), CPU_WORLD
        )
        weights_dir = announce(tmp_path / "step_1", broadcaster.manifest(1))
        trainer_model = load_model(other_weights_dir)  # what the trainer would hold after a step
        timings: dict = {}
        sender = threading.Thread(target=lambda: timings.update(broadcaster.send(trainer_model, None)))
        sender.start()
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(weights_dir), "step": 1}, timeout=60)
        sender.join(timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["weight_step"] == 1
        assert timings["bytes"] == sum(p.numel() * 4 for p in trainer_model.parameters())  # fp32, tied head once
        via_broadcast = greedy(server.url, prompt)

        # The same weights from files give the same tokens.
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 2})
        assert r.status_code == 200, r.text
        assert greedy(server.url, prompt) == via_broadcast != before

        # The group stays open: a second broadcast (several buckets again) lands too.
        weights_dir = announce(tmp_path / "step_3", broadcaster.manifest(3))
        base_model = load_model(model_dir)
        sender = threading.Thread(target=broadcaster.send, args=(base_model, None))
        sender.start()
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(weights_dir), "step": 3}, timeout=60)
        sender.join(timeout=60)
        assert r.status_code == 200, r.text
        assert greedy(server.url, prompt) == before
    finally:
        server.stop()


def test_trainer_fails_within_timeout_when_no_worker_joins():
    port = free_port()
    broadcaster = WeightBroadcaster(WeightBroadcastConfig(type="nccl", port=port, timeout_s=2), CPU_WORLD)
    model = load_model({"model_type": "qwen3", **_tiny()})
    t0 = time.perf_counter()
    with pytest.raises(
        BroadcastTimeout, match=rf"1 inference worker\(s\) did not all join the store at 127.0.0.1:{port}"
    ):
        broadcaster.send(model, None)
    assert time.perf_counter() - t0 < 10


def test_server_fails_within_timeout_when_the_trainer_never_sends(tmp_path, model_dir):
    server = start_server(model_dir)
    try:
        prompt = [5, 6, 7]
        before = greedy(server.url, prompt)
        manifest = BroadcastManifest(
            step=1, host="127.0.0.1", port=free_port(), world_size=2, backend="gloo", timeout_s=2
        )
        weights_dir = announce(tmp_path / "step_1", manifest)
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(weights_dir), "step": 1}, timeout=60)
        assert time.perf_counter() - t0 < 10
        assert r.status_code == 504
        assert "could not join the trainer's weight broadcast at 127.0.0.1" in r.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health").json()
        assert health["weight_step"] == 0
        assert greedy(server.url, prompt) == before
        # source=filesystem refuses a directory without safetensors instead of waiting for a broadcast.
        r = httpx.post(
            f"{server.url}/update_weights", json={"weight_dir": str(weights_dir), "source": "filesystem"}, timeout=60
        )
        assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    finally:
        server.stop()


def _tiny() -> dict:
    return dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
