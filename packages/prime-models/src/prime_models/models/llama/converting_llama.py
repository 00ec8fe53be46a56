"""Llama <-> HF state dict: names already match; only the tied lm_head needs care."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from prime_models.models.common_converting import dense_from_hf, dense_to_hf


def from_hf(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    return dense_from_hf(hf_state, tie_word_embeddings=args.tie_word_embeddings)


def to_hf(name: str, tensor: torch.Tensor, args) -> Iterator[tuple[str, torch.Tensor]]:
    return dense_to_hf(name, tensor, tie_word_embeddings=args.tie_word_embeddings)
