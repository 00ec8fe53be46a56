"""Activation checkpointing for decoder layers that expose an `ac_mode` attribute.

Modes:
* ``none``: keep every activation.
* ``full``: recompute every decoder layer in backward (only layer inputs are kept). `keep_attention=N` also keeps the
  attention-kernel outputs of the last N layers (-1: all), recomputing their projections, norms and MLP but not the
  attention itself: `2 * heads * head_dim` more bytes per token and kept layer, for one attention forward less each.
  `mlp_chunks=N` runs each dense MLP as one node that keeps only its input and, in backward, recomputes it in N
  sequence chunks (`prime_models.layers.chunked_mlp`): the backward peak holds one chunk's MLP intermediates instead
  of all of them, and the layer recompute skips the MLP, so no extra compute. MoE layers ignore it.
  `offload_attention=True` (with keep_attention) moves the kept attention outputs to pinned host memory between
  forward and backward, copied on a side stream that overlaps compute (`prime_models.parallel.attention_offload`):
  the GPU then holds at most two layers' kept outputs instead of N, bitwise the same results.
* ``selective``: recompute every `every`-th decoder layer fully (every=2 halves the kept activations), or, with
  `every=0`, recompute only each layer's attention block (norm + projections + attention) while MLP activations are
  kept.
"""

from __future__ import annotations

from torch import nn

from prime_models.layers.moe import MoE
from prime_models.parallel.attention_offload import AttentionOffload

AC_MODES = ("none", "full", "selective")


def apply_activation_checkpointing(
    layers: nn.ModuleList,
    mode: str = "none",
    every: int = 2,
    keep_attention: int = 0,
    mlp_chunks: int = 0,
    offload_attention: bool = False,
) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; known: {AC_MODES}")
    if every < 0:
        raise ValueError(f"every must be >= 0, got {every}")
    if mlp_chunks < 0:
        raise ValueError(f"mlp_chunks must be >= 0, got {mlp_chunks}")
    if mlp_chunks and mode != "full":
        raise ValueError(f"mlp_chunks needs mode 'full' (it relies on the layer's recompute), got mode {mode!r}")
    if offload_attention and (mode != "full" or keep_attention == 0):
        raise ValueError(
            f"offload_attention needs mode 'full' and keep_attention != 0 (it moves the kept attention outputs), "
            f"got mode {mode!r}, keep_attention={keep_attention}"
        )
    offload = AttentionOffload() if offload_attention else None
    for i, layer in enumerate(layers):
        layer.ac_keep_attention = keep_attention < 0 or i >= len(layers) - keep_attention
        layer.ac_offload_attention = offload if layer.ac_keep_attention else None
        layer.ac_mlp_chunks = 0 if isinstance(getattr(layer, "mlp", None), MoE) else mlp_chunks
        if mode == "none":
            layer.ac_mode = "none"
        elif mode == "full":
            layer.ac_mode = "full"
        elif every == 0:
            layer.ac_mode = "attn"
        else:
            layer.ac_mode = "full" if i % every == 0 else "none"
