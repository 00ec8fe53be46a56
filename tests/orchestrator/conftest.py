"""Helpers: a tiny random Qwen3 with a locally built ChatML tokenizer, and the torch inference engine."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

CORPUS = [
    "the quick brown fox jumps over the lazy dog <reversed> </reversed> \\boxed{12}",
    '<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call> higher lower correct',
    "cat dog sun moon tree bird fish rain snow wind star leaf rock sand sea sky 0 1 2 3 4 5 6 7 8 9",
] * 20


def build_model(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
