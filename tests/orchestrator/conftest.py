"""Helpers: a tiny random Qwen3 with a locally built ChatML tokenizer, and the torch inference engine."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.tiny import build_chatml_tokenizer, free_port, tiny_qwen3_config

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


class TorchServer:
    """The real ``prime_inference`` torch engine, served in a thread."""

    def __init__(self, model_dir: Path):
        import uvicorn
        from prime_core.config.inference import InferenceConfig
        from prime_inference.engines import build_engine
        from prime_inference.server import build_app

        port = free_port()
        config = InferenceConfig.model_validate(
            {
                "model": {"name": str(model_dir), "dtype": "float32"},
                "engine": "torch",
                "max_model_len": 512,
                "server": {"port": port},
                "log": {"file": False},
            }
        )
        self.url = f"http://127.0.0.1:{port}"
        app = build_app(config, lambda: build_engine(config))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("inference server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("orch_model") / "base")


@pytest.fixture(scope="session")
def torch_server(tiny_model):
    pytest.importorskip("prime_inference.server")
    s = TorchServer(tiny_model)
    yield s
    s.stop()


def publish_weights(run_root: Path, step: int, model_dir: Path) -> None:
    """What the trainer does: an HF directory at weights/step_N, then STABLE."""
    from prime_core.io import atomic_dir

    with atomic_dir(run_root / "weights" / f"step_{step}") as tmp:
        for f in model_dir.iterdir():
            if f.is_file() and f.name != "STABLE":
                shutil.copy(f, tmp / f.name)
