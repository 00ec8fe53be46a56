"""Parallelize function shared by the decoder families (AC, then FSDP2, in torchtitan's order)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from prime_core.config.shared import Fp8Config
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from prime_models.parallel.activation_checkpoint import apply_activation_checkpointing
from prime_models.parallel.dims import ParallelDims
from prime_models.parallel.fp8 import apply_fp8
from prime_models.parallel.fsdp import apply_fsdp, default_mp_policy


def parallelize_transformer(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    mesh: DeviceMesh | None = None,
    ac: str = "none",
    ac_every: int = 2,
    ac_keep_attention: int = 0,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    fp8: Fp8Config | None = None,
) -> nn.Module:
    """Apply activation checkpointing and, when dp > 1, FSDP2 to a `CausalLM` in place; returns it.

    Args:
        model: a model from `load_model` (its decoder layers live in `model.model.layers`).
        parallel_dims: validated axis sizes.
        mesh: device mesh from `parallel_dims.build_mesh`; built from the model's device when omitted.
        ac: "none", "full" or "selective" (see `prime_models.parallel.activation_checkpoint`).
        ac_every: for "selective": checkpoint every k-th layer; 0 checkpoints only the attention block of each layer.
        ac_keep_attention: with "full": keep the attention kernel's outputs of the last N layers (-1: all) instead of
            recomputing them in backward.
        param_dtype / reduce_dtype: override the default mixed precision (bf16/fp32 on CUDA, fp32/fp32 on CPU).
        cpu_offload: keep sharded params, grads and optimizer state on CPU (`CPUOffloadPolicy`).
        reshard_after_forward: free gathered params after each layer's forward (ZeRO-3); False keeps them (ZeRO-2).
        fp8: `model.fp8` section: swap the decoder's linears (and MoE experts) for FP8 ones first
            (`prime_models.parallel.fp8`); later steps shard the same parameters.
    """
    layers = model.model.layers
    apply_fp8(model, fp8)
    apply_activation_checkpointing(layers, ac, ac_every, keep_attention=ac_keep_attention)
    if not parallel_dims.fsdp_enabled:
        return model
    device_type = next(model.parameters()).device.type
    if cpu_offload and device_type == "cpu":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if mesh is None:
        mesh = parallel_dims.build_mesh(device_type)
    mp = default_mp_policy(device_type)
    if param_dtype is not None or reduce_dtype is not None:
        mp = type(mp)(param_dtype=param_dtype or mp.param_dtype, reduce_dtype=reduce_dtype or mp.reduce_dtype)
    return apply_fsdp(
        model,
        layers,
        parallel_dims.fsdp_mesh(mesh),
        mp_policy=mp,
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )
