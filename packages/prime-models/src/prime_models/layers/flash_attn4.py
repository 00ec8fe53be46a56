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


def _backward(ctx, dout_TND: torch.Tensor, _dlse: torch.Tensor | None):
    # The log-sum-exp is only ever read by this backward, so its gradient is always zero.
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = interface()._flash_attn_bwd(
        q, k, v, out, dout_TND.contiguous(), lse, ctx.scale, True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=ctx.max_seqlen, max_seqlen_k=ctx.max_seqlen,
    )[:3]  # fmt: skip
    return dq, dk, dv, None, None, None


flash_attn4_varlen.register_autograd(_backward, setup_context=_setup_context)
