"""Causal self-attention over packed rows.

A row may hold several samples; `position_ids` restart at 0 at each sample start and attention never crosses a sample
boundary. Two backends:

* ``sdpa``: torch's own kernels. Unpacked rows use `torch.nn.functional.scaled_dot_product_attention` with
  `is_causal=True`. Packed rows on CUDA whose packing the caller computed on the host (`row_packing`, as the trainer
  does) use torch's variable-length flash kernel (`torch.nn.attention.varlen`) over the flattened tokens, so a row's
  samples cost their own causal blocks and nothing across them; otherwise (CPU, a packing the forward reads itself,
  `kernels.SDPA_VARLEN` off, fp32 activations) SDPA with a block-diagonal causal boolean mask `[B, 1, S, S]` (S^2
  bytes per row, e.g. 64 MiB at 8k tokens, and the whole causal triangle computed). CUDA graphs replay the same
  choice (`prime_models.parallel.cuda_graphs`).
* ``flash_attn``: FlashAttention-2's `flash_attn_varlen_func` over the flattened `[B*S]` tokens with `cu_seqlens`
  derived from `position_ids` (no mask at all).
* ``flash_attn4``: FlashAttention-4 (`flash-attn-4`, Hopper and Blackwell) the same way, through the custom op of
  `prime_models.layers.flash_attn4` so that activation checkpointing can keep its output.

Sampling passes a `prime_models.layers.kv_cache.KVCacheStep` instead: each layer stores its new K/V in the cache and
attends over it (the torch inference engine serves with this same forward).

Context parallelism hooks in through `CONTEXT_PARALLEL`: while a `prime_models.parallel.context_parallel.CPShard` is
active, `build_attention_metadata` hands it to every layer and attention runs as a ring over the CP group.

Where the samples start is a fact of the rows, computed from `position_ids`; on a GPU that costs a read-back (a sync
of the stream) in every forward. A caller holding the rows in host memory (the trainer) computes it there once
(`row_packing`) and sets it around the forward with `use_row_packing`; `build_attention_metadata` then reads nothing
back.

Shape legend: B batch, S sequence, T = B*S tokens, H hidden, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prime_models import kernels
from prime_models.layers.common import RMSNorm, apply_rotary
from prime_models.layers.flash_attn4 import flash_attn4_varlen
from prime_models.layers.kv_cache import KVCacheStep

ATTN_BACKENDS = ("sdpa", "flash_attn", "flash_attn4")
FLASH_BACKENDS = ("flash_attn", "flash_attn4")
"""Backends that attend over the flattened samples of ``cu_seqlens`` and never take a mask."""

# The active context-parallel split of the current forward (set by `CPShard.__enter__`), else None.
CONTEXT_PARALLEL: ContextVar[Any] = ContextVar("prime_context_parallel", default=None)


@dataclass
class AttentionMetadata:
    """Per-forward attention layout, computed once from `position_ids` and shared by every layer."""

    backend: str
    mask_B1SS: torch.Tensor | None = None  # sdpa, packed rows only
    cu_seqlens: torch.Tensor | None = None  # FLASH_BACKENDS, sdpa's packed rows on CUDA: int32 [num_samples + 1]
    max_seqlen: int = 0
    context_parallel: Any = None  # a CPShard: ring attention over the context-parallel group
    kv_cache: KVCacheStep | None = None  # sampling: attend over a KV cache instead of the rows
    position_ids_BS: torch.Tensor | None = None  # sdpa's packed rows on CUDA: for the mask, if a layer needs it

    def packed_mask(self) -> torch.Tensor:
        """The block-diagonal causal mask of packed rows, built at the first call (sdpa's fallback from the varlen
        kernel, e.g. for fp32 activations, which that kernel does not take)."""
        if self.mask_B1SS is None:
            self.mask_B1SS = block_causal_mask(self.position_ids_BS)
        return self.mask_B1SS


def sample_starts(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Boolean `[B, S]`: True where a new sample begins (position 0, and always at the row start)."""
    starts = position_ids_BS == 0
    starts[:, 0] = True
    return starts


def cu_seqlens_from_position_ids(position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sample lengths over the flattened batch, as flash-attn's varlen kernels expect."""
    starts = sample_starts(position_ids_BS).flatten()
    total = starts.numel()
    idx = starts.nonzero().squeeze(-1)
    cu = torch.cat([idx, idx.new_tensor([total])]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    return cu, max_seqlen


@dataclass(frozen=True)
class RowPacking:
    """Where the samples of a forward's rows start, computed in host memory (`row_packing`)."""

    shape: tuple[int, int]
    """[B, S] of the rows it describes; a forward over other rows ignores it."""
    packed: bool
    """Some row holds several samples (SDPA then attends through a block-diagonal mask)."""
    cu_seqlens: torch.Tensor
    """flash_attn's cumulative sample lengths over the flattened rows (int32, on the forward's device)."""
    max_seqlen: int


VARLEN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_HEAD_DIMS = range(8, 257, 8)
"""What torch's varlen flash kernel takes; other activations fall back to SDPA with a mask."""

ROW_PACKING: ContextVar[RowPacking | None] = ContextVar("prime_row_packing", default=None)


def varlen_applies(device: torch.device | None) -> bool:
    """Whether packed rows on ``device`` attend through torch's varlen kernel (else through a mask)."""
    return (
        device is not None and device.type == "cuda" and kernels.SDPA_VARLEN and kernels.torch_varlen_attn() is not None
    )


def varlen_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's varlen kernel takes activations of ``dtype`` and heads of ``head_dim`` (else the mask)."""
    return dtype in VARLEN_DTYPES and head_dim in VARLEN_HEAD_DIMS


def row_packing(position_ids_BS: torch.Tensor, device: torch.device | None = None) -> RowPacking:
    """The packing of rows whose ``position_ids`` are in host memory; ``cu_seqlens`` is copied to ``device``."""
    assert position_ids_BS.device.type == "cpu", "row_packing reads position_ids on the host"
    starts = sample_starts(position_ids_BS)
    cu, max_seqlen = cu_seqlens_from_position_ids(position_ids_BS)
    packed = bool((starts.sum(-1) > 1).any())
    cu = cu.to(device, non_blocking=True) if device is not None else cu
    return RowPacking(tuple(position_ids_BS.shape), packed, cu, max_seqlen)


@contextmanager
def use_row_packing(packing: RowPacking | None) -> Iterator[None]:
    """Forwards in this context take the rows' packing from ``packing`` instead of reading position_ids back."""
    token = ROW_PACKING.set(packing)
    try:
        yield
    finally:
        ROW_PACKING.reset(token)


def build_attention_metadata(
    position_ids_BS: torch.Tensor, backend: str, kv_cache: KVCacheStep | None = None
) -> AttentionMetadata:
    if kv_cache is not None:
        return AttentionMetadata(backend, kv_cache=kv_cache)
    shard = CONTEXT_PARALLEL.get()
    if shard is not None:
        # The shard built its masks from the full rows; the local position_ids only drive RoPE.
        return AttentionMetadata(backend, context_parallel=shard)
    known = ROW_PACKING.get()
    if known is not None and known.shape != tuple(position_ids_BS.shape):
        known = None
    if backend in FLASH_BACKENDS:
        if known is not None:
            return AttentionMetadata(backend, cu_seqlens=known.cu_seqlens, max_seqlen=known.max_seqlen)
        cu, max_seqlen = cu_seqlens_from_position_ids(position_ids_BS)
        return AttentionMetadata(backend, cu_seqlens=cu, max_seqlen=max_seqlen)
    if backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r}; known: {ATTN_BACKENDS}")
    if known is not None and not known.packed:
        return AttentionMetadata(backend)
    if known is not None and known.cu_seqlens.numel() and varlen_applies(known.cu_seqlens.device):
        return AttentionMetadata(
            backend, cu_seqlens=known.cu_seqlens, max_seqlen=known.max_seqlen, position_ids_BS=position_ids_BS
        )
    if known is None and not bool((sample_starts(position_ids_BS).sum(-1) > 1).any()):  # a read-back: a GPU sync
        return AttentionMetadata(backend)
    return AttentionMetadata(backend, mask_B1SS=block_causal_mask(position_ids_BS))


def block_causal_mask(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Boolean `[B, 1, S, S]`: causal within each sample of a packed row, nothing across samples."""
    seq = position_ids_BS.shape[1]
    doc_BS = sample_starts(position_ids_BS).cumsum(-1)
    causal_SS = torch.ones(seq, seq, dtype=torch.bool, device=position_ids_BS.device).tril()
    return ((doc_BS[:, :, None] == doc_BS[:, None, :]) & causal_SS).unsqueeze(1)


class Attention(nn.Module):
    """Grouped-query attention with optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        layer_idx: int = 0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx  # which of a KV cache's layers is this one's
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps)
            self.k_norm = RMSNorm(head_dim, norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if meta.kv_cache is not None:
            out = meta.kv_cache.attend(self.layer_idx, q, k, v, self.scale)
        elif meta.context_parallel is not None:
            out = meta.context_parallel.attention(q, k, v, self.scale)
        elif meta.backend in FLASH_BACKENDS or (meta.cu_seqlens is not None and varlen_takes(q.dtype, self.head_dim)):
            out = self._varlen(q, k, v, meta)
        else:
            out = self._sdpa(q, k, v, meta)
        return self.o_proj(out.reshape(B, S, -1))

    def _sdpa(self, q_BSND, k_BSKD, v_BSKD, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = q_BSND.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2)
        mask = meta.packed_mask() if meta.cu_seqlens is not None else meta.mask_B1SS
        rep = self.num_heads // self.num_kv_heads
        if rep > 1 and mask is None and q.is_cuda and kernels.SDPA_NATIVE_GQA:
            with kernels.sdpa_backend_context(q.device):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return out.transpose(1, 2)
        if rep > 1:
            # Expanding K/V (rather than enable_gqa) keeps every SDPA backend eligible, masked ones included.
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with kernels.sdpa_backend_context(q.device):
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2)

    def _varlen(self, q_BSND, k_BSKD, v_BSKD, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the flattened rows' samples (`meta.cu_seqlens`): FlashAttention-2's or -4's varlen kernel
        for their backends, torch's own for SDPA's packed rows."""
        B, S = q_BSND.shape[:2]
        q_TND = q_BSND.reshape(B * S, self.num_heads, self.head_dim)
        k_TKD = k_BSKD.reshape(B * S, self.num_kv_heads, self.head_dim)
        v_TKD = v_BSKD.reshape(B * S, self.num_kv_heads, self.head_dim)
        if meta.backend == "flash_attn4":
            out, _ = flash_attn4_varlen(q_TND, k_TKD, v_TKD, meta.cu_seqlens, meta.max_seqlen, self.scale)
            return out.view(B, S, self.num_heads, self.head_dim)
        if meta.backend == "flash_attn":
            fn, causal = kernels.flash_attn_varlen_func(), dict(softmax_scale=self.scale, causal=True)
        else:
            fn, causal = kernels.torch_varlen_attn(), dict(scale=self.scale, window_size=(-1, 0))
        out = fn(
            q_TND,
            k_TKD,
            v_TKD,
            meta.cu_seqlens,
            meta.cu_seqlens,
            meta.max_seqlen,
            meta.max_seqlen,
            **causal,
        )
        return out.view(B, S, self.num_heads, self.head_dim)
