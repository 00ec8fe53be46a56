"""State-dict conversion shared by the dense families, whose parameter names equal HF's."""

from __future__ import annotations

from collections.abc import Iterator

import torch

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def dense_from_hf(hf_state: dict[str, torch.Tensor], *, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """HF names -> ours. Drops rotary buffers some older checkpoints carry."""
    state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    if tie_word_embeddings:
        # Tied checkpoints usually omit lm_head; our lm_head aliases the embedding, so a copy would be redundant.
        state.pop(LM_HEAD, None)
    return state


def dense_to_hf(name: str, tensor: torch.Tensor, *, tie_word_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """One of our (name, tensor) -> HF (name, tensor) pairs; HF omits the tied lm_head."""
    if tie_word_embeddings and name == LM_HEAD:
        return
    yield name, tensor
