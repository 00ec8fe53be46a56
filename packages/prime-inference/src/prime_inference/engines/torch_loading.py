"""Weights for the torch engine, built off its scheduler thread while the served model keeps sampling: a model loaded
from a directory, or a copy of the served one filled with streamed tensors (a broadcast), and the check that new
weights fit the served model."""

from __future__ import annotations

import copy
from typing import Any

import torch
from prime_core.config.inference import InferenceConfig
from prime_core.schemas.weights import Manifest

from prime_inference.engines.model_runner import load_causal_lm


def text_config(hf_config: Any) -> Any:
    """The language model's config (vision-language configs nest it as ``text_config``)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def eos_ids(hf_config: Any, tokenizer: Any) -> set[int]:
    """The ids that end a sequence: the model config's and the tokenizer's EOS."""
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def load_model(
    path: str,
    config: InferenceConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    adapters_of: Any = None,
    served_source: str | None = None,
) -> tuple[Any, str, Any]:
    """(model, "prime_models" | "transformers", HF config) of ``path``; ``adapters_of``: a served model whose LoRA
    adapters the new one takes over (their files may be gone by now); ``served_source``: the implementation of the
    served model, which new weights must load with. Unreadable files and non-finite tensors raise `ValueError`."""
    trust = config.model.trust_remote_code
    from safetensors import SafetensorError

    try:
        model, source = load_causal_lm(
            path, dtype=dtype, device=device, trust_remote_code=trust, fallback=served_source != "prime_models"
        )
    except SafetensorError as e:  # truncated or corrupt: a 500 without a reason (and retried) before
        raise ValueError(f"unreadable safetensors ({e})") from e
    check_finite(model)
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(text_config(hf_config), "vocab_size"):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    if adapters_of is not None:
        from prime_models.lora import copy_adapters

        copy_adapters(adapters_of, model)
    return model, source, hf_config


def receive_model(manifest: Manifest, served: Any, source: str, dtype: torch.dtype, device: torch.device) -> Any:
    """Receive every tensor, then load a copy of the served model (the running one keeps serving meanwhile)."""
    from prime_inference.weights import stream_receiver

    tensors = stream_receiver(manifest).tensors(manifest, device)
    # A bucket may be reused once the next one is asked for (CUDA IPC buffers): keep copies.
    state = {name: t.to(dtype, copy=True) for bucket in tensors for name, t in bucket}
    model = copy.deepcopy(served)
    what = f"{manifest.type} weights of step {getattr(manifest, 'step', '?')}"
    if source == "prime_models":
        from prime_models.loading import load_hf_state

        load_hf_state(model, state, source=what)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = getattr(model, "_tied_weights_keys", None) or ()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"{what} do not match the served model: missing={missing} unexpected={unexpected}")
    check_finite(model, what)
    return model


def check_finite(model: Any, what: str = "") -> None:
    """Refuse weights with a NaN or infinite value: served, every logit is NaN and each request samples token 0 while
    the server reports the new step (a trainer bug or a corrupt file; one pass over the weights, cheap beside
    loading them)."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what}{': ' if what else ''}{name} holds NaN or infinite values")


def check_compatible(new_config: Any, served_config: Any) -> None:
    """New weights must have the served model's shape (the KV cache and the tokenizer stay)."""
    from prime_inference.protocol import RequestError

    for key in ("vocab_size", "num_hidden_layers", "hidden_size", "num_key_value_heads", "model_type"):
        new, old = getattr(text_config(new_config), key, None), getattr(text_config(served_config), key, None)
        if new != old:
            raise RequestError(f"weight_dir has {key}={new!r}, the served model has {old!r}", param="weight_dir")
