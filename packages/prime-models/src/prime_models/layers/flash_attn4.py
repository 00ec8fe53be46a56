"""FlashAttention-4 (the `flash-attn-4` package: CuTe-DSL kernels for Hopper and Blackwell) as a torch custom op.

FA4's own entry point is a `torch.autograd.Function`, which the dispatcher never sees. Activation checkpointing's
keep-attention policy (`parallel.ac_keep_attention`) and its host offload pick the attention kernel out by op, so
an op is what lets a fully checkpointed layer keep FA4's output instead of running the attention forward again in
backward. The op is registered whether or not FA4 is installed (the checkpoint policy names it at import); its
kernels import FA4 only when called. FA4 compiles each kernel configuration on its first call (seconds) and
caches it for the process.

Shapes: T flattened tokens of the rows, N query heads, K kv heads (GQA is native), D head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch


@functools.cache
def interface():
    """FA4's `flash_attn.cute.interface` (the flash-attn-4 distribution; `resolve_attn` checked that it imports)."""
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("prime_models::flash_attn4_varlen", mutates_args=())
def flash_attn4_varlen(
    q_TND: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each sample of ``cu_seqlens`` (int32 ``[samples + 1]``): ``(out_TND, lse_NT)``."""
    # return_lse: inside an op the inputs never require grad, and FA4 skips the log-sum-exp backward needs otherwise.
    out, lse = interface()._flash_attn_fwd(
        q_TND, k_TKD, v_TKD, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, return_lse=True,
    )[:2]  # fmt: skip
    return out, lse


@flash_attn4_varlen.register_fake
def _(q_TND, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q_TND), q_TND.new_empty((q_TND.shape[1], q_TND.shape[0]), dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


LONG_ROW_TOKENS = 8192
"""Samples at least this long take `long_row_backward`'s tiles on Hopper (the shortest row length measured)."""


@contextlib.contextmanager
def long_row_backward(fa4, max_seqlen: int):
    """FA4's Hopper backward for causal head dim 128 takes FA3's 64x128 tiles. 80x128 tiles (dQ's MMA swapped, as FA4
    does for 80-row tiles) ran 1.3-5.0% faster at every row length measured, 8k to 64k tokens, on an H200, and a 64k
    row's trainer step 1.7% faster (benchmarks/results/fa4_tiles_h200.json). FA4 reads its backward tiles from a
    table, not from the call's arguments, so the table answers differently for this call only; an FA4 without that
    table, or whose configuration has other fields, is left as it is."""
    own = getattr(fa4, "_tile_size_bwd_sm90", None)
    if own is None or max_seqlen < LONG_ROW_TOKENS:
        yield
        return

    def table(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        cfg = own(head_dim, head_dim_v, causal, local, sparse_block_size_q=sparse_block_size_q)
        fields = {f.name for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else set()
        if (head_dim, head_dim_v, causal, local, sparse_block_size_q) != (128, 128, True, False, None) or not {
            "m_block_size", "dQ_swapAB"} <= fields:  # fmt: skip
            return cfg
        return dataclasses.replace(cfg, m_block_size=80, dQ_swapAB=True)

    fa4._tile_size_bwd_sm90 = table
    try:
        yield
    finally:
        fa4._tile_size_bwd_sm90 = own


@torch.library.custom_op("prime_models::flash_attn4_varlen_backward", mutates_args=())
def flash_attn4_varlen_backward(
    q_TND: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    out_TND: torch.Tensor,
    dout_TND: torch.Tensor,
    lse_NT: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `flash_attn4_varlen`. An op of its own, so that a compiled layer's backward graph calls the
    kernel instead of tracing into FA4's Python, which reads data pointers that traced tensors do not have."""
    with long_row_backward(interface(), max_seqlen):
        dq, dk, dv = interface()._flash_attn_bwd(
            q_TND, k_TKD, v_TKD, out_TND, dout_TND, lse_NT, scale, True, cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        )[:3]  # fmt: skip
    return dq, dk, dv


@flash_attn4_varlen_backward.register_fake
def _(q_TND, k_TKD, v_TKD, out_TND, dout_TND, lse_NT, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q_TND), torch.empty_like(k_TKD), torch.empty_like(v_TKD)


def _backward(ctx, dout_TND: torch.Tensor, _dlse: torch.Tensor | None):
    # The log-sum-exp is only ever read by this backward, so its gradient is always zero.
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn4_varlen_backward(q, k, v, out, dout_TND.contiguous(), lse, cu_seqlens, ctx.max_seqlen,
                                             ctx.scale)  # fmt: skip
    return dq, dk, dv, None, None, None


flash_attn4_varlen.register_autograd(_backward, setup_context=_setup_context)
