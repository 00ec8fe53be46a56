"""Helpers: a tiny random Qwen3 with a locally built ChatML tokenizer, and the torch inference engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fixtures.scripted import InProcessServer, torch_server_config
from tests.tiny import build_chatml_tokenizer, tiny_qwen3_config

CORPUS = [
    "the quick brown fox jumps over the lazy dog <reversed> </reversed> \\boxed{12}",
    '<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call> higher lower correct',
    "cat dog sun moon tree bird fish rain snow wind star leaf rock sand sea sky 0 1 2 3 4 5 6 7 8 9",
] * 20


def build_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    tokenizer = build_chatml_tokenizer(CORPUS)
    config = tiny_qwen3_config(tokenizer, max_position_embeddings=512)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class TorchServer(InProcessServer):
    """The real ``prime_inference`` torch engine, served in a thread."""

    def __init__(self, model_dir: Path, **overrides):
        from prime_inference.engines import build_engine

        config = torch_server_config(model_dir, max_model_len=512, **overrides)
        super().__init__(config, lambda: build_engine(config))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("orch_model") / "base")


@pytest.fixture(scope="session")
def shared_torch_server(tiny_model):
    pytest.importorskip("prime_inference.server")
    s = TorchServer(tiny_model)
    yield s
    s.stop()


@pytest.fixture
def torch_server(shared_torch_server):
    """The session's server, on its base weights: a test that had it load a run's weights left them served, and the
    next test's rollouts were sampled with them, recorded as a step that test's trainer never published (which an
    orchestrator refuses: a server serving another run's weights)."""
    import httpx

    url = shared_torch_server.url
    if httpx.get(f"{url}/health", timeout=10).json().get("weight_step"):
        httpx.post(f"{url}/reload_weights", timeout=60).raise_for_status()
    return shared_torch_server


def publish_weights(run_root: Path, step: int, model_dir: Path) -> None:
    """What the trainer does: an HF directory at weights/step_N, then STABLE."""
    from prime_core.io import atomic_dir

    with atomic_dir(run_root / "weights" / f"step_{step}") as tmp:
        for f in model_dir.iterdir():
            if f.is_file() and f.name != "STABLE":
                shutil.copy(f, tmp / f.name)
