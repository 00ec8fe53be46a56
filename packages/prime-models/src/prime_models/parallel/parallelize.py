"""Parallelize function shared by the decoder families (EP, then AC, then FSDP2, in torchtitan's order).

Context parallelism changes no parameter: it is applied per forward (`prime_models.parallel.context_parallel`). On one
rank there is nothing to shard: mixed precision then comes from `prime_models.parallel.mixed_precision` (a working
copy in the compute dtype over the fp32 masters) instead of an FSDP2 wrap that would redo its work every forward.
"""

from __future__ import annotations

import torch
from prime_core.config.shared import Fp8Config
from torch import nn

from prime_models.parallel.activation_checkpoint import apply_activation_checkpointing
from prime_models.parallel.compile import compile_layers as compile_all
from prime_models.parallel.cuda_graphs import apply_cuda_graphs
from prime_models.parallel.dims import ParallelDims, ParallelMesh
from prime_models.parallel.expert_parallel import apply_expert_parallel
from prime_models.parallel.fsdp import apply_fsdp, default_mp_policy
from prime_models.parallel.mixed_precision import apply_mixed_precision
from prime_models.quantization.float8 import apply_fp8


def _one_rank(model: nn.Module, param_dtype: torch.dtype, cuda_graphs: bool) -> nn.Module:
    """Nothing to shard: compute in `param_dtype` on a working copy when the parameters have another dtype, replayed
    from CUDA graphs with ``cuda_graphs``."""
    if param_dtype != next(model.parameters()).dtype:
        apply_mixed_precision(model, param_dtype)
    if cuda_graphs:
        apply_cuda_graphs(model)
    return model


def _swap_inside_layers(model: nn.Module, fp8: Fp8Config | None, compile_layers: bool) -> None:
    """What changes the layers' own classes, before anything wraps them: FP8 linears, compiled layer forwards."""
    apply_fp8(model, fp8)
    if compile_layers:
        compile_all(model.model.layers)


def _device_type(model: nn.Module, cpu_offload: bool) -> str:
    """Where the model computes: its parameters' device, or CUDA when they are offloaded to the host."""
    device_type = next(model.parameters()).device.type
    if cpu_offload and device_type == "cpu":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return device_type


def _mp_policy(device_type: str, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
    """The device's default mixed precision with the caller's overrides."""
    mp = default_mp_policy(device_type)
    if param_dtype is not None or reduce_dtype is not None:
        mp = type(mp)(param_dtype=param_dtype or mp.param_dtype, reduce_dtype=reduce_dtype or mp.reduce_dtype)
    return mp


def parallelize_transformer(
    model: nn.Module,
    parallel_dims: ParallelDims,
    *,
    mesh: ParallelMesh | None = None,
    ac: str = "none",
    ac_every: int = 2,
    ac_keep_attention: int = 0,
    ac_mlp_chunks: int = 0,
    ac_offload_attention: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    dispatcher: str = "torch",
    fp8: Fp8Config | None = None,
    one_rank_fsdp: bool = False,
    compile_layers: bool = False,
    cuda_graphs: bool = False,
) -> nn.Module:
    """Apply expert parallelism, activation checkpointing and, when dp * cp > 1, FSDP2 to a `CausalLM` in place. One
    rank computes in `param_dtype` over its parameters as masters (`apply_mixed_precision`) instead of under FSDP2.

    Args:
        model: a model from `load_model` (its decoder layers live in `model.model.layers`); with ep > 1 every rank
            must hold the same full weights.
        parallel_dims: validated axis sizes.
        mesh: device meshes from `parallel_dims.build_mesh`; built for the model's device when omitted.
        ac, ac_every, ac_keep_attention, ac_mlp_chunks, ac_offload_attention: activation checkpointing mode and its
            options (`apply_activation_checkpointing`'s mode, every, keep_attention, mlp_chunks, offload_attention;
            `prime_models.parallel.activation_checkpoint`).
        param_dtype / reduce_dtype: override the default mixed precision (bf16/fp32 on CUDA, fp32/fp32 on CPU).
        cpu_offload: keep sharded params, grads and optimizer state on CPU (`CPUOffloadPolicy`; FSDP2 on one GPU too).
        reshard_after_forward: free gathered params after each layer's forward (ZeRO-3); False keeps them (ZeRO-2).
        dispatcher: expert-parallel token dispatch, "torch" (all-to-all) or "deepep" (GPU, needs DeepEP).
        fp8: `model.fp8` section: swap the decoder's linears (and MoE experts) for FP8 ones first
            (`prime_models.quantization.float8`); later steps shard the same parameters.
        one_rank_fsdp: wrap a one-rank model in FSDP2 as on several ranks (casts and hooks every forward).
        compile_layers: compile each decoder layer's forward (`prime_models.parallel.compile`), inside its checkpoint.
        cuda_graphs: one rank only: replay the decoder stack from CUDA graphs (`prime_models.parallel.cuda_graphs`).
    """
    layers = model.model.layers
    _swap_inside_layers(model, fp8, compile_layers)
    device_type = _device_type(model, cpu_offload)
    if mesh is None and (parallel_dims.fsdp_enabled or parallel_dims.ep_enabled):
        mesh = parallel_dims.build_mesh(device_type)
    if parallel_dims.ep_enabled:
        parallel_dims.validate_experts(getattr(model.args, "num_experts", 0))
        apply_expert_parallel(model, mesh.ep, dispatcher)
    apply_activation_checkpointing(layers, ac, ac_every, ac_keep_attention, ac_mlp_chunks, ac_offload_attention)
    mp = _mp_policy(device_type, param_dtype, reduce_dtype)
    if not parallel_dims.fsdp_enabled and not (one_rank_fsdp or (cpu_offload and device_type == "cuda")):
        return _one_rank(model, mp.param_dtype, cuda_graphs)
    if cuda_graphs:
        raise ValueError("cuda graphs serve one rank without FSDP2 (no fsdp_one_rank, cpu_offload or dp > 1)")
    mesh = mesh or parallel_dims.build_mesh(device_type)
    divide = float(parallel_dims.dp_replicate * parallel_dims.fsdp_size)
    return apply_fsdp(model, layers, mesh.fsdp, mp_policy=mp, cpu_offload=cpu_offload,
                      reshard_after_forward=reshard_after_forward, expert_mesh=mesh.expert_fsdp,
                      gradient_divide_factor=divide)  # fmt: skip
