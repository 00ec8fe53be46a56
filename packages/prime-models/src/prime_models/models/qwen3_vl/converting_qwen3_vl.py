"""Qwen3-VL <-> HF state dict: HF nests the LM under `model.language_model.` and the ViT under `model.visual.`."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from prime_models.models.common_converting import dense_from_hf, dense_to_hf

_HF_TO_OURS = (("model.language_model.", "model."), ("model.visual.", "visual."))


def from_hf(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in hf_state.items():
        for hf_prefix, ours in _HF_TO_OURS:
            if name.startswith(hf_prefix):
                name = ours + name[len(hf_prefix) :]
                break
        state[name] = tensor
    return dense_from_hf(state, tie_word_embeddings=args.tie_word_embeddings)


def to_hf(name: str, tensor: torch.Tensor, args) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_prefix, ours in _HF_TO_OURS:
        if name.startswith(ours):
            name = hf_prefix + name[len(ours) :]
            break
    yield from dense_to_hf(name, tensor, tie_word_embeddings=args.tie_word_embeddings)
