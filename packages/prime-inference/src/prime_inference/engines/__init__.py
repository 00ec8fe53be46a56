"""Engine selection. Engines import torch or vLLM, so they are imported only once one is chosen."""

from __future__ import annotations

import importlib.util
from typing import Any

from prime_core.config.inference import InferenceConfig

from prime_inference.engines.base import Engine

TORCH_HINT = "the torch engine needs the `torch` extra: pip install 'prime-inference[torch]'"
VLLM_HINT = "the vLLM engine needs the `vllm` extra and a CUDA GPU: pip install 'prime-inference[vllm]'"


def select_engine(config: InferenceConfig) -> str:
    """``auto``: vLLM when it is installed and CUDA is available, else the PyTorch engine."""
    if config.engine != "auto":
        return config.engine
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return "torch"
    import torch

    return "vllm" if torch.cuda.is_available() else "torch"


def load_tokenizer(config: InferenceConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.name, trust_remote_code=config.model.trust_remote_code)


def build_engine(config: InferenceConfig) -> tuple[Engine, Any]:
    """Build the configured engine and the tokenizer the server uses for chat templates and detokenization."""
    kind = select_engine(config)
    if kind == "vllm":
        try:
            from prime_inference.engines.vllm_engine import VllmEngine
        except ImportError as e:
            raise RuntimeError(f"{VLLM_HINT} ({e})") from e
        engine = VllmEngine(config)
        return engine, engine.tokenizer
    try:
        from prime_inference.engines.torch_engine import TorchEngine
    except ImportError as e:
        raise RuntimeError(f"{TORCH_HINT} ({e})") from e
    tokenizer = load_tokenizer(config)
    return TorchEngine(config, tokenizer), tokenizer
