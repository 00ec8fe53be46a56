"""A slotted KV cache, so that the training model's own forward also samples (prefill, then one token at a time).

`KVCache` holds, per decoder layer, K and V `[num_slots, K, capacity, D]`; a running sequence owns one slot. The
capacity grows by doubling up to `max_len` and is released when nothing runs, so memory follows the longest running
sequence. One forward gets a `KVCacheStep` (which slots, which cache positions, prefill or decode) through
`CausalLM.forward_hidden(..., kv_cache=step)`; each `Attention` layer then writes its new K/V into the cache and attends
over it instead of over the packed rows. Rotary positions stay the caller's `position_ids` (a vision-language prompt
shifts them), cache positions are the step's.

Shape legend: B batch (running sequences), S new tokens, T cached length, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_slots, self.max_len, self.dtype, self.device = num_slots, max_len, dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.capacity = 0

    def ensure_capacity(self, needed: int) -> None:
        """Room for `needed` positions per slot; cached K/V are kept."""
        if needed <= self.capacity:
            return
        new_cap = min(self.max_len, max(needed, 2 * self.capacity, 64))
        shape = (self.num_slots, self.num_kv_heads, new_cap, self.head_dim)
        old_k, old_v, old_cap = self.k, self.v, self.capacity
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for i in range(len(old_k)):
            self.k[i][:, :, :old_cap] = old_k[i]
            self.v[i][:, :, :old_cap] = old_v[i]
        self.capacity = new_cap

    def release(self) -> None:
        """Drop the cache memory (when no sequence runs)."""
        self.k, self.v, self.capacity = [], [], 0

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Give slot `dst` the first `length` cached positions of slot `src`."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def prefill(self, slots_B: torch.Tensor, length: int) -> KVCacheStep:
        """A forward of whole prompts (one per row, from cache position 0, `length` tokens) into `slots_B`."""
        self.ensure_capacity(length + 1)
        return KVCacheStep(self, slots_B, None, None, slice(0, 0))

    def decode(self, slots_B: torch.Tensor, positions_B: torch.Tensor) -> KVCacheStep:
        """A forward of one new token per row, at cache position `positions_B`, attending over the slot's prefix."""
        T = int(positions_B.max().item()) + 1
        self.ensure_capacity(T)
        mask_B11T = (torch.arange(T, device=self.device)[None, :] <= positions_B[:, None]).view(-1, 1, 1, T)
        B = slots_B.shape[0]
        contiguous = bool((slots_B == torch.arange(B, device=slots_B.device) + slots_B[0]).all())
        rows = slice(int(slots_B[0]), int(slots_B[0]) + B) if contiguous else slots_B
        return KVCacheStep(self, slots_B, positions_B, mask_B11T, rows)


@dataclass(frozen=True)
class KVCacheStep:
    """One forward's view of a `KVCache`: what `Attention` needs to write and read it."""

    cache: KVCache
    slots_B: torch.Tensor
    positions_B: torch.Tensor | None
    """Decode: the cache position of each row's new token; None for a prefill."""
    mask_B11T: torch.Tensor | None
    """Decode: which cached positions each row attends to."""
    rows: slice | torch.Tensor
    """Decode: the slots to read, as a slice when they are contiguous (a view, no gather)."""

    def attend(self, layer: int, q_BSND: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, scale: float):
        """Store this layer's new K/V, attend over the cache; returns `[B, S, N, D]`."""
        q, k, v = q_BSND.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        cache_k, cache_v = self.cache.k[layer], self.cache.v[layer]
        if self.positions_B is None:
            # One sequence per row, all starting at position 0: plain causal attention, then fill the cache.
            S = q.shape[2]
            cache_k[self.slots_B, :, :S] = k
            cache_v[self.slots_B, :, :S] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            cache_k[self.slots_B, :, self.positions_B] = k[:, :, 0]
            cache_v[self.slots_B, :, self.positions_B] = v[:, :, 0]
            T = self.mask_B11T.shape[-1]
            keys, values = cache_k[self.rows, :, :T], cache_v[self.rows, :, :T]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask_B11T, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
