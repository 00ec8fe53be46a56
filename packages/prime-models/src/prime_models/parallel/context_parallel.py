"""Context parallelism: each packed row is split over the `cp` ranks of a group; attention runs as a ring.

Layout (load-balanced zig-zag): a row of S tokens is cut into `2 * cp` equal chunks and rank r keeps chunks r and
`2*cp - 1 - r`, so under a causal mask every rank has about the same attention work. Everything but attention is
token-wise and runs on the local tokens unchanged; RoPE uses the real `position_ids` of the local tokens.

Ring attention: each rank keeps its queries, and the K/V blocks travel around the ring (rank r sends to r + 1). Every
(query block, K/V block) pair is one attention call returning its output and log-sum-exp; the partial results merge
exactly with log-sum-exp weights. The mask of a pair comes from the full row, which every rank of the group holds: a
query attends to a key iff both lie in the same packed sample (`position_ids` restart at 0) and the key is not later
in the row. Pairs with no allowed (query, key) are skipped. Backward runs the ring again: K/V travel with their
gradient accumulators, which arrive back at their owner after `cp` hops.

Attention kernels (each returns the log-sum-exp the merge needs and has a backward taking the merged output):
CUDA `aten._scaled_dot_product_efficient_attention` with an additive bias, CPU
`aten._scaled_dot_product_flash_attention_for_cpu` with an additive mask. Memory: the boolean masks of all blocks
(`S^2 / cp` bytes per row) plus one block's bias (`(S / cp)^2` elements) at a time, like the SDPA backend's packed-row
mask; a mask-free kernel per zig-zag chunk pair (flash-attn varlen) is the known next step for very long rows.

Usage (every rank of the CP group, same full rows):

    shard = ContextParallel(cp_mesh).shard(position_ids_RS)
    with shard:
        lp_local, _ = model(shard.split(input_ids_RS), shard.split(position_ids_RS), targets=shard.split(targets_RS))
    lp_RS = shard.gather(lp_local)  # differentiable; every rank gets the full rows

Shape legend: R rows, S full sequence, Q local queries (S / cp), N query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from prime_models.layers.attention import CONTEXT_PARALLEL, sample_starts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Row positions held by `rank`: chunks `rank` and `2*cp - 1 - rank` of `2*cp` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len={seq_len} must be divisible by 2 * cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


class ContextParallel:
    """A context-parallel group (a 1-D device mesh or process group); `shard` prepares one micro-batch."""

    def __init__(self, mesh_or_group: DeviceMesh | dist.ProcessGroup):
        self.group = mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def shard(self, position_ids_RS: torch.Tensor) -> CPShard:
        return CPShard(self, position_ids_RS)


class CPShard:
    """One micro-batch's split over the CP group: local positions, per-source-rank masks, split/gather helpers.

    Use as a context manager around the model's forward: attention layers then run the ring (see module docstring).
    """

    def __init__(self, cp: ContextParallel, position_ids_RS: torch.Tensor):
        self.cp = cp
        self.group, self.size, self.rank = cp.group, cp.size, cp.rank
        num_rows, self.seq_len = position_ids_RS.shape
        device = position_ids_RS.device
        self.indices = [zigzag_index(self.seq_len, self.size, r, device) for r in range(self.size)]
        self.index = self.indices[self.rank]
        self.inverse = torch.cat(self.indices).argsort()
        self.next_rank = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev_rank = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

        doc_RS = sample_starts(position_ids_RS).cumsum(-1)
        q_doc = doc_RS[:, self.index]
        self.allowed: list[torch.Tensor | None] = []
        self.empty_rows: list[torch.Tensor | None] = []
        for src in range(self.size):
            k_index = self.indices[src]
            allowed_RQK = (q_doc[:, :, None] == doc_RS[:, None, k_index]) & (
                k_index[None, None, :] <= self.index[None, :, None]
            )
            if not bool(allowed_RQK.any()):
                self.allowed.append(None)
                self.empty_rows.append(None)
                continue
            self.allowed.append(allowed_RQK)
            self.empty_rows.append(~allowed_RQK.any(-1))
        self._token = None

    # -- data ---------------------------------------------------------------------------------------------------

    def split(self, t_RS: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a `[R, S, ...]` tensor."""
        return t_RS.index_select(1, self.index)

    def gather(self, t_RQ: torch.Tensor) -> torch.Tensor:
        """Full rows from every rank's local tokens (differentiable: gradients go back to the owning rank)."""
        from torch.distributed.nn.functional import all_gather

        parts = all_gather(t_RQ.contiguous(), group=self.group)
        return torch.cat(parts, dim=1).index_select(1, self.inverse)

    # -- attention ----------------------------------------------------------------------------------------------

    def __enter__(self) -> CPShard:
        self._token = CONTEXT_PARALLEL.set(self)
        return self

    def __exit__(self, *exc) -> None:
        CONTEXT_PARALLEL.reset(self._token)
        self._token = None

    def bias(self, src: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask `[R, 1, Q, K]` (0 allowed, -inf masked) of local queries vs. rank `src`'s keys; None if empty."""
        allowed = self.allowed[src]
        if allowed is None:
            return None
        num_rows, q, k = allowed.shape
        # Built per use rather than cached: only one block's bias is alive at a time. The CUDA kernel wants bias rows
        # 16-element aligned, so the storage is padded and the kernel gets a view.
        padded = -(-k // 16) * 16
        bias = torch.full((num_rows, 1, q, padded), float("-inf"), dtype=dtype, device=allowed.device)
        bias[..., :k].masked_fill_(allowed[:, None], 0.0)
        return bias[..., :k]

    def attention(self, q_RQND: torch.Tensor, k_RQGD: torch.Tensor, v_RQGD: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal, sample-masked attention of the local queries over the whole row. Returns `[R, Q, N, D]`."""
        q, k, v = (t.transpose(1, 2) for t in (q_RQND, k_RQGD, v_RQGD))
        return _RingAttention.apply(q, k, v, self, scale).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------- kernels


def _expand_kv(t_RGKD: torch.Tensor, num_heads: int) -> torch.Tensor:
    rep = num_heads // t_RGKD.shape[1]
    return t_RGKD.repeat_interleave(rep, dim=1) if rep > 1 else t_RGKD


def _reduce_kv(grad_RNKD: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    r, n, k, d = grad_RNKD.shape
    return grad_RNKD.view(r, num_kv_heads, n // num_kv_heads, k, d).sum(2) if n != num_kv_heads else grad_RNKD


def _block_forward(q, k, v, bias, scale):
    """(out `[R, N, Q, D]`, lse `[R, N, Q]` fp32, state for the backward) of one block."""
    if q.is_cuda:
        bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale
        )
        return out, lse[..., : q.shape[2]].float(), (lse.shape[-1], seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse.float(), None


def _block_backward(dout, q, k, v, bias, out, lse, scale, state):
    """(dq, dk, dv) of one block given the merged output and log-sum-exp (the flash-attention backward identity)."""
    if q.is_cuda:
        lse_len, seed, offset = state
        # The kernel stores the log-sum-exp padded to its tile size; hand the merged one back in that layout.
        lse = torch.nn.functional.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


class _Ring:
    """Sends a buffer to the next rank of the group while receiving the previous rank's into a new one."""

    def __init__(self, shard: CPShard):
        self.shard = shard
        self.works: list = []

    def start(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.shard.next_rank, self.shard.group),
            dist.P2POp(dist.irecv, recv, self.shard.prev_rank, self.shard.group),
        ]
        self.works = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_RNQD, k_RGQD, v_RGQD, shard: CPShard, scale: float):
        num_heads = q_RNQD.shape[1]
        kv = torch.stack([k_RGQD, v_RGQD]).contiguous()
        ring = _Ring(shard)
        out = lse = None
        states = {}
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            incoming = ring.start(kv) if step < shard.size - 1 else None
            bias = shard.bias(src, q_RNQD.dtype)
            if bias is not None:
                k, v = _expand_kv(kv[0], num_heads), _expand_kv(kv[1], num_heads)
                block_out, block_lse, states[src] = _block_forward(q_RNQD, k, v, bias, scale)
                block_out = block_out.float()
                empty = shard.empty_rows[src][:, None]  # [R, 1, Q]: queries with no key in this block
                block_lse = block_lse.masked_fill(empty, float("-inf"))
                block_out = block_out.masked_fill(empty[..., None], 0.0)
                if out is None:
                    out, lse = block_out, block_lse
                else:
                    # The own block (step 0) gives every query its diagonal, so `lse` is finite from then on.
                    merged = torch.logaddexp(lse, block_lse)
                    out = out * (lse - merged).exp()[..., None] + block_out * (block_lse - merged).exp()[..., None]
                    lse = merged
            if incoming is not None:
                ring.wait()
                kv = incoming
        out = out.to(q_RNQD.dtype)
        ctx.save_for_backward(q_RNQD, k_RGQD, v_RGQD, out, lse)
        ctx.shard, ctx.scale, ctx.states = shard, scale, states
        return out

    @staticmethod
    def backward(ctx, dout_RNQD):
        q, k_own, v_own, out, lse = ctx.saved_tensors
        shard, scale = ctx.shard, ctx.scale
        num_heads, num_kv_heads = q.shape[1], k_own.shape[1]
        dout = dout_RNQD.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k_own, v_own]).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        kv_ring, dkv_ring = _Ring(shard), _Ring(shard)
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            incoming_kv = kv_ring.start(kv) if step < shard.size - 1 else None
            bias = shard.bias(src, q.dtype)
            if bias is not None:
                k, v = _expand_kv(kv[0], num_heads), _expand_kv(kv[1], num_heads)
                dq_, dk_, dv_ = _block_backward(dout, q, k, v, bias, out, lse, scale, ctx.states[src])
                dq += dq_
                dkv[0] += _reduce_kv(dk_.float(), num_kv_heads)
                dkv[1] += _reduce_kv(dv_.float(), num_kv_heads)
            # The gradient accumulator travels with its K/V block; after `cp` hops it is back at the block's owner.
            dkv = dkv_ring.start(dkv)
            dkv_ring.wait()
            if incoming_kv is not None:
                kv_ring.wait()
                kv = incoming_kv
        return dq.to(q.dtype), dkv[0].to(k_own.dtype), dkv[1].to(v_own.dtype), None, None


@contextlib.contextmanager
def no_context_parallel():
    """Run a forward without ring attention inside a CP context (e.g. a rank-local evaluation)."""
    token = CONTEXT_PARALLEL.set(None)
    try:
        yield
    finally:
        CONTEXT_PARALLEL.reset(token)
