"""Each weight transport through the whole seam, in one process on CPU: the trainer's publisher (chosen from the
trainer config by `build_publisher`) announces ``weights/step_1``, the orchestrator's relay posts it, the server's
receiver (chosen by the manifest) makes the torch engine serve exactly the trainer's weights."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch
import torch.distributed as dist
from prime_core.config.trainer import TrainerConfig
from prime_core.io import wait_stable
from prime_core.run_dir import RunDir
from prime_models import load_model
from prime_orchestrator import client
from prime_trainer.weights import PUBLISHERS, build_publisher
from prime_trainer.world import World

from tests.inference.helpers import start_server
from tests.tiny import free_port


def greedy(url: str, prompt: list[int]) -> list[int]:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture
def one_rank(tmp_path):
    """The trainer's world as one CPU rank (publishing runs collectives over it)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    dist.destroy_process_group()


@pytest.mark.parametrize("transport,broadcast_type", [("filesystem", "filesystem"), ("broadcast", "nccl")])
def test_published_step_is_served_exactly(transport, broadcast_type, tmp_path, model_dir, other_weights_dir, one_rank):
    config = TrainerConfig.model_validate({
        "model": {"name": str(model_dir)}, "output_dir": str(tmp_path / "run"),
        "weights": {"broadcast": {"type": broadcast_type, "port": free_port(), "timeout_s": 60, "bucket_mb": 1}},
    })  # fmt: skip
    run_dir = RunDir(config.output_dir)
    publisher = build_publisher(config, "trainer", run_dir, one_rank, tokenizer=str(model_dir))
    assert type(publisher) is PUBLISHERS[transport]
    server = start_server(model_dir)
    try:
        prompt = [5, 6, 7, 8, 9]
        before = greedy(server.url, prompt)
        trainer_model = load_model(other_weights_dir)  # what the trainer holds after a step
        timings: dict = {}
        sender = threading.Thread(target=lambda: timings.update(publisher.publish(1, trainer_model, durable=False)))
        sender.start()
        step_dir = wait_stable(run_dir.weight_step(1), timeout=60)
        asyncio.run(client.update_weights([server.url], str(step_dir), 1, api_key=None, timeout=60, retries=1))
        sender.join(timeout=60)
        assert not sender.is_alive()
        assert httpx.get(f"{server.url}/health").json()["weight_step"] == 1
        served = greedy(server.url, prompt)
        # One-time transfers leave no weights behind; files are the weights.
        assert any(step_dir.glob("*.safetensors")) == (transport == "filesystem")
        assert ("send_s" in timings) == (transport == "broadcast")

        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 2})
        assert r.status_code == 200, r.text
        assert greedy(server.url, prompt) == served != before
    finally:
        server.stop()
