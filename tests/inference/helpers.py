"""A tiny random Qwen3 model with a locally built tokenizer, and an in-process server on a free port."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "reverse the text: abc def ghi",
    "numbers 0 1 2 3 4 5 6 7 8 9 and more words",
] * 20


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_model(path: Path, tokenizer, seed: int) -> Path:
    import torch
    from prime_core.io import mark_stable
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # spread the logits so sampling and greedy decoding are not degenerate
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, config, startup_timeout: float = 60):
        import uvicorn
        from prime_inference.engines import build_engine
        from prime_inference.server import build_app

        self.config = config
        self.url = f"http://127.0.0.1:{config.server.port}"
        app = build_app(config, lambda: build_engine(config))
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=config.server.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        headers = {"Authorization": f"Bearer {config.server.api_key}"} if config.server.api_key else {}
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: Path, **overrides) -> RunningServer:
    from prime_core.config.inference import InferenceConfig

    startup_timeout = overrides.pop("startup_timeout", 60)
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
    return RunningServer(config, startup_timeout)
