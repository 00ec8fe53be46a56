"""A tiny random Qwen3 model with a locally built tokenizer, and an in-process server on a free port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.tiny import CHAT_TEMPLATE, build_chatml_tokenizer, free_port, tiny_qwen3_config  # noqa: F401

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "reverse the text: abc def ghi",
    "numbers 0 1 2 3 4 5 6 7 8 9 and more words",
] * 20


def build_tokenizer():
    return build_chatml_tokenizer(CORPUS)


def save_model(path: Path, tokenizer, seed: int, max_position_embeddings: int = 256) -> Path:
    import torch
    from prime_core.io import mark_stable
    from transformers import Qwen3ForCausalLM

    config = tiny_qwen3_config(tokenizer, max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # spread the logits so sampling and greedy decoding are not degenerate
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)
    return path


class RunningServer:
    """``build_app`` served by uvicorn in a thread; ``engine_factory`` replaces the configured engine (test engines)."""

    def __init__(self, config, startup_timeout: float = 60, engine_factory=None):
        import uvicorn
        from prime_inference.connections import uvicorn_config
        from prime_inference.engines import build_engine
        from prime_inference.server import build_app

        self.config = config
        self.url = f"http://127.0.0.1:{config.server.port}"
        app = build_app(config, engine_factory or (lambda: build_engine(config)))
        self.server = uvicorn.Server(uvicorn_config(app, config, host="127.0.0.1", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        key = config.server.resolved_api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if not self.thread.is_alive():  # uvicorn gave up on startup (the engine failed): its log says why
                raise RuntimeError(f"server on {self.url} exited while starting")
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server on {self.url} not healthy after {startup_timeout} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: Path, **overrides) -> RunningServer:
    from prime_core.config.inference import InferenceConfig

    startup_timeout = overrides.pop("startup_timeout", 60)
    engine_factory = overrides.pop("engine_factory", None)
    server = {"port": free_port(), **overrides.pop("server", {})}
    config = InferenceConfig.model_validate(
        {
            "model": {"name": str(model_dir), "dtype": "float32"},
            "engine": "torch",
            "max_model_len": 128,
            "server": server,
            "log": {"file": False},
            **overrides,
        }
    )
    return RunningServer(config, startup_timeout, engine_factory)


def start_vllm_server(model_dir: Path, **overrides) -> RunningServer:
    """`start_server` on the vLLM engine as the GPU tests run it: bf16 (vLLM 0.26's V2 model runner hits an illegal
    memory access warming up an fp32 model), eager, 30% of the GPU; ``vllm`` entries add to those."""
    vllm = {"gpu_memory_utilization": 0.3, "enforce_eager": True, **overrides.pop("vllm", {})}
    model = {"name": str(model_dir), "dtype": "bfloat16", **overrides.pop("model", {})}
    return start_server(model_dir, engine="vllm", model=model, vllm=vllm, startup_timeout=600, **overrides)


@contextlib.contextmanager
def inference_server(model_dir, engine: str, tmp_path, *more: str) -> Iterator[str]:
    """The `inference` command in a process of its own (its main thread, its limits, its crash), bf16 on one GPU;
    yields its URL once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "prime_inference.entrypoints.inference", "--engine", engine, "--model.name",
           str(model_dir), "--model.dtype", "bfloat16", "--server.port", str(port), "--output-dir", str(tmp_path / "inf"),
           "--max-model-len", "128", "--vllm.gpu-memory-utilization", "0.3", "--vllm.enforce-eager", *more]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert server.poll() is None, f"inference exited during startup (rc={server.returncode})"
            assert time.time() < deadline, "inference not healthy after 600 s"
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pid, signal.SIGKILL)
