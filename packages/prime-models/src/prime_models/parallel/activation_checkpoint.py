"""Activation checkpointing, applied to a model's decoder layers from outside (the model files know nothing of it).

Each chosen layer's forward runs as a whole under `torch.utils.checkpoint` (the layer's class is swapped for a
checkpointing subclass; parameter names and the module tree stay as they are, so conversion, LoRA, FSDP2 and
checkpoints see the same model). What a checkpointed layer keeps for backward is a save-ops policy
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`).

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
* ``selective``: with `every=k >= 1`, recompute every k-th decoder layer fully (k=2 halves the kept activations);
  with `every=0`, checkpoint every layer under a save-ops policy that keeps the attention kernels' and matmuls'
  outputs and recomputes the cheap rest (norms, rotary embedding, activation functions, residual adds).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from prime_models import kernels
from prime_models.layers.chunked_mlp import chunk_mlp, skip_chunked_mlp_in_recompute
from prime_models.layers.flash_attn4 import flash_attn4_varlen  # noqa: F401 (registers the op ATTENTION_OPS names)
from prime_models.layers.moe import MoE
from prime_models.parallel.attention_offload import AttentionOffload

AC_MODES = ("none", "full", "selective")


def _ops(names: tuple[str, ...]) -> frozenset:
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


ATTENTION_OPS = _ops(("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention", "_flash_attention_forward",
                      "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu")
                     ) | kernels.varlen_attention_ops() | {torch.ops.prime_models.flash_attn4_varlen.default}  # fmt: skip
"""Attention kernels whose outputs `keep_attention` keeps (and `offload_attention` moves to host memory)."""
MATMUL_OPS = _ops(("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm"))


def _save_ops_policy(save: frozenset) -> Callable[..., CheckpointPolicy]:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@dataclass(frozen=True)
class LayerCheckpoint:
    """How one decoder layer is checkpointed."""

    save_ops: frozenset = frozenset()
    """Ops whose outputs the layer keeps for backward instead of recomputing them."""
    offload: AttentionOffload | None = None
    """Holds the kept attention outputs in host memory (shared by the model's layers), or None."""
    mlp_chunks: int = 0
    """> 0: the layer's dense MLP runs in this many sequence chunks and the layer's recompute skips it."""

    def context_fn(self) -> tuple[Any, Any]:
        """The `torch.utils.checkpoint` contexts of one forward: (forward, recompute)."""
        if self.offload is not None:
            contexts = functools.partial(self.offload.checkpoint_contexts, set(self.save_ops))
        elif self.save_ops:
            contexts = functools.partial(create_selective_checkpoint_contexts, _save_ops_policy(self.save_ops))
        else:
            contexts = noop_context_fn
        return skip_chunked_mlp_in_recompute(contexts)() if self.mlp_chunks else contexts()


_APPLIED: weakref.WeakKeyDictionary[nn.Module, LayerCheckpoint] = weakref.WeakKeyDictionary()


def layer_checkpoint(layer: nn.Module) -> LayerCheckpoint | None:
    """How `layer` was checkpointed, or None when it was not."""
    return _APPLIED.get(layer)


class _Checkpointed:
    """Mixed into a decoder layer's class by `checkpoint_layer`: its forward runs under `torch.utils.checkpoint`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        context_fn = _APPLIED[self].context_fn
        # Decoder layers draw random numbers only in LoRA dropout, which CUDA graphs do not serve: under a capture
        # the RNG state is not stashed (reading it there is illegal).
        preserve = not (args and isinstance(args[0], torch.Tensor) and kernels.capturing(args[0]))
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=context_fn,
                          preserve_rng_state=preserve, **kwargs)  # fmt: skip


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})


def checkpoint_layer(layer: nn.Module, plan: LayerCheckpoint) -> None:
    """Wrap `layer` (a module whose forward is one decoder block) with activation checkpointing per `plan`.

    In place, the way FSDP2's `fully_shard` swaps a module's class: parameter names, children and hooks stay."""
    if plan.mlp_chunks:
        chunk_mlp(layer.mlp, plan.mlp_chunks)
    if not isinstance(layer, _Checkpointed):
        layer.__class__ = _checkpointed_class(type(layer))
    _APPLIED[layer] = plan


def _check(mode: str, every: int, keep_attention: int, mlp_chunks: int, offload_attention: bool) -> None:
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


def layer_plans(
    num_layers: int, mode: str, every: int, keep_attention: int, mlp_chunks: int, offload: AttentionOffload | None
) -> list[LayerCheckpoint | None]:
    """Per layer: how to checkpoint it, or None to keep all its activations."""
    if mode == "none":
        return [None] * num_layers
    if mode == "selective":
        if every == 0:
            return [LayerCheckpoint(save_ops=ATTENTION_OPS | MATMUL_OPS)] * num_layers
        return [LayerCheckpoint() if i % every == 0 else None for i in range(num_layers)]
    plans = []
    for i in range(num_layers):
        keep = keep_attention < 0 or i >= num_layers - keep_attention
        plans.append(
            LayerCheckpoint(
                save_ops=ATTENTION_OPS if keep else frozenset(),
                offload=offload if keep else None,
                mlp_chunks=mlp_chunks,
            )
        )
    return plans


def apply_activation_checkpointing(
    layers: nn.ModuleList,
    mode: str = "none",
    every: int = 2,
    keep_attention: int = 0,
    mlp_chunks: int = 0,
    offload_attention: bool = False,
) -> None:
    """Checkpoint the decoder `layers` (a model's `model.model.layers`) in place; see the module docstring."""
    _check(mode, every, keep_attention, mlp_chunks, offload_attention)
    offload = AttentionOffload() if offload_attention else None
    for layer, plan in zip(
        layers, layer_plans(len(layers), mode, every, keep_attention, mlp_chunks, offload), strict=True
    ):
        if plan is None:
            continue
        if plan.mlp_chunks and isinstance(getattr(layer, "mlp", None), MoE):
            plan = LayerCheckpoint(plan.save_ops, plan.offload)
        checkpoint_layer(layer, plan)
