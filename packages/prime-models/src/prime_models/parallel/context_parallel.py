"""Context parallelism: each packed row is split over the `cp` ranks of a group; attention runs as a ring.

Layout (load-balanced zig-zag): a row of S tokens is cut into `2 * cp` equal chunks of C = S / (2 * cp) tokens and
rank r keeps chunks r and `2*cp - 1 - r`, so under a causal mask every rank has about the same attention work.
Everything but attention is token-wise and runs on the local tokens unchanged; RoPE uses the real `position_ids` of the
local tokens.

Ring attention: each rank keeps its queries, and the K/V blocks travel around the ring (rank r sends to r + 1). A
query attends to a key iff both lie in the same packed sample (`position_ids` restart at 0) and the key is not later
in the row. Each (query chunk, key chunk) pair is planned once per micro-batch from the rows' sample starts, without
any mask: a key chunk later in the row is skipped; an earlier one can share at most one sample with the query chunk
(sample ids only grow along the row), so the visible part is one rectangle, a prefix of the queries times a suffix of
the keys, attended with no mask; a chunk with itself is block-diagonal causal, so every sample of at least
`mask_tile` tokens is one `is_causal` call and runs of shorter samples are grouped into pieces of at most `mask_tile`
tokens, the only calls with a mask (`mask_tile^2`, built from the pieces' sample ids when used and dropped after).
Rows with the same plan share calls; others get their own. Every call returns its output and log-sum-exp and the
partial results merge exactly with log-sum-exp weights. Backward runs the ring again over the same plan, rebuilding
the small masks: K/V travel with their gradient accumulators, which arrive back at their owner after `cp` hops.

Attention kernels (each returns the log-sum-exp the merge needs and has a backward taking the merged output):
on CUDA, `aten._scaled_dot_product_flash_attention` (FlashAttention-2) for the mask-free calls in bf16/fp16 and
`aten._scaled_dot_product_efficient_attention` for the masked ones and fp32 (FlashAttention takes no bias); on CPU,
`aten._scaled_dot_product_flash_attention_for_cpu`.
Memory per attention layer and row, beyond the activations CP=1 keeps: the fp32 output/log-sum-exp accumulators,
the K/V block in flight and the gradient accumulators (all O(S / cp)), plus at most one `mask_tile^2` mask and
bias; nothing grows with S^2.

Usage (every rank of the CP group, same full rows):

    shard = ContextParallel(cp_mesh).shard(position_ids_RS)
    with shard:
        lp_local, _ = model(shard.split(input_ids_RS), shard.split(position_ids_RS), targets=shard.split(targets_RS))
    lp_RS = shard.gather(lp_local)  # differentiable; every rank gets the full rows

Shape legend: R rows, S full sequence, Q local queries (S / cp), N query heads, G kv heads, D head dim.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from prime_models.layers.attention import CONTEXT_PARALLEL, sample_starts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Samples shorter than this are grouped into masked pieces of at most this many tokens; longer ones run mask-free.
# 1024 bounds the mask at 1M elements per row while keeping the number of kernel calls per chunk small.
DEFAULT_MASK_TILE = 1024


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Row positions held by `rank`: chunks `rank` and `2*cp - 1 - rank` of `2*cp` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len={seq_len} must be divisible by 2 * cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


class ContextParallel:
    """A context-parallel group (a 1-D device mesh or process group); `shard` prepares one micro-batch.

    `mask_tile` trades memory for kernel calls: runs of samples shorter than it are attended in masked pieces of at
    most `mask_tile` tokens (one `mask_tile^2` mask at a time); longer samples need no mask.
    """

    def __init__(self, mesh_or_group: DeviceMesh | dist.ProcessGroup, mask_tile: int = DEFAULT_MASK_TILE):
        if mask_tile < 1:
            raise ValueError(f"context parallelism: mask_tile={mask_tile} must be a positive number of tokens")
        self.group = mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.mask_tile = mask_tile

    def shard(self, position_ids_RS: torch.Tensor) -> CPShard:
        return CPShard(self, position_ids_RS)


FULL, CAUSAL, MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class _Call:
    """One attention kernel call: rows `[r0, r1)`, local queries `[q0, q1)` vs. the K/V block's keys `[k0, k1)`.

    `kind` is FULL (every query sees every key), CAUSAL (the same tokens on both sides, causal) or MASKED (a small
    piece with sample boundaries inside: its mask comes from the sample ids of the global positions `[g0, g1)`).
    """

    r0: int
    r1: int
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str
    g0: int = 0
    g1: int = 0


def _pair_calls(starts: list[int], seq_len: int, chunk: int, q_chunk: int, k_chunk: int, tile: int) -> list[tuple]:
    """(q0, q1, k0, k1, kind, g0, g1) of one row's (query chunk, key chunk) pair, offsets within the chunks.

    `starts` are the row's sample starts (sorted, starting with 0).
    """
    q_begin, k_begin = q_chunk * chunk, k_chunk * chunk
    if k_chunk > q_chunk:
        return []
    if k_chunk < q_chunk:
        # Sample ids only grow along the row, so the last key's sample is the only one both chunks can hold.
        sample = bisect.bisect_right(starts, k_begin + chunk - 1) - 1
        sample_start = starts[sample]
        sample_end = starts[sample + 1] if sample + 1 < len(starts) else seq_len
        if sample_end <= q_begin:
            return []
        q_end = min(sample_end, q_begin + chunk)
        return [(0, q_end - q_begin, max(sample_start, k_begin) - k_begin, chunk, FULL, 0, 0)]
    first, last = bisect.bisect_right(starts, q_begin), bisect.bisect_left(starts, q_begin + chunk)
    bounds = [q_begin, *starts[first:last], q_begin + chunk]
    calls, piece = [], None  # piece: [begin, end, number of samples] of the short samples being grouped

    def flush():
        if piece is not None:
            b, e, n = piece
            calls.append((b - q_begin, e - q_begin, b - q_begin, e - q_begin, CAUSAL if n == 1 else MASKED, b, e))

    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end - begin >= tile:
            flush()
            piece = None
            calls.append((begin - q_begin, end - q_begin, begin - q_begin, end - q_begin, CAUSAL, 0, 0))
        elif piece is not None and end - piece[0] <= tile:
            piece = [piece[0], end, piece[2] + 1]
        else:
            flush()
            piece = [begin, end, 1]
    flush()
    return calls


def plan_ring(starts_per_row: list[list[int]], seq_len: int, cp: int, rank: int, src: int, tile: int) -> list[_Call]:
    """Every kernel call of `rank`'s queries against rank `src`'s K/V block (local offsets, chunk pairs unrolled)."""
    chunk = seq_len // (2 * cp)
    num_rows = len(starts_per_row)
    calls = []
    for q_local, q_chunk in enumerate((rank, 2 * cp - 1 - rank)):
        for k_local, k_chunk in enumerate((src, 2 * cp - 1 - src)):
            per_row = [_pair_calls(s, seq_len, chunk, q_chunk, k_chunk, tile) for s in starts_per_row]
            # Rows with the same layout in this pair share one batched call per piece.
            groups = (
                [(0, num_rows, per_row[0])]
                if all(p == per_row[0] for p in per_row)
                else [(r, r + 1, p) for r, p in enumerate(per_row)]
            )
            for r0, r1, row_calls in groups:
                for q0, q1, k0, k1, kind, g0, g1 in row_calls:
                    qo, ko = q_local * chunk, k_local * chunk
                    calls.append(_Call(r0, r1, q0 + qo, q1 + qo, k0 + ko, k1 + ko, kind, g0, g1))
    return calls


class CPShard:
    """One micro-batch's split over the CP group: local positions, the ring's call plan, split/gather helpers.

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

        starts_RS = sample_starts(position_ids_RS)
        # Per-token sample ids (O(S) per row): the only input of the small masks, built when a call uses one.
        self.doc_RS = starts_RS.cumsum(-1)
        rows, cols = starts_RS.nonzero(as_tuple=True)
        starts_per_row: list[list[int]] = [[] for _ in range(num_rows)]
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            starts_per_row[r].append(c)
        self.plans = [
            plan_ring(starts_per_row, self.seq_len, self.size, self.rank, src, cp.mask_tile) for src in range(self.size)
        ]
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

    def bias(self, call: _Call, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask `[rows, 1, n, n]` (0 allowed, -inf masked) of a MASKED call's piece; None for other calls."""
        if call.kind != MASKED:
            return None
        doc = self.doc_RS[call.r0 : call.r1, call.g0 : call.g1]
        n = call.g1 - call.g0
        allowed = (doc[:, :, None] == doc[:, None, :]).tril_()
        # The CUDA kernel wants bias rows 16-element aligned, so the storage is padded and the kernel gets a view; the
        # CPU kernel would copy such a view, so there the bias stays dense.
        padded = -(-n // 16) * 16 if doc.is_cuda else n
        bias = torch.full((call.r1 - call.r0, 1, n, padded), float("-inf"), dtype=dtype, device=doc.device)
        bias[..., :n].masked_fill_(allowed[:, None], 0.0)
        return bias[..., :n]

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


def _use_flash(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """FlashAttention-2 takes no bias, only half precision, head dims up to 256, and Ampere or newer."""
    if not q.is_cuda or bias is not None or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] > 256:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 8


def _block_forward(q, k, v, bias, causal, scale):
    """(out `[R, N, Q, D]`, lse `[R, N, Q]` fp32, state for the backward) of one call."""
    if _use_flash(q, bias):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    if q.is_cuda:
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float(), (lse.shape[-1], seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out, lse.float(), None


def _block_backward(dout, q, k, v, bias, causal, out, lse, scale, state):
    """(dq, dk, dv) of one call given the merged output and log-sum-exp (the flash-attention backward identity)."""
    if state is not None and state[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    if q.is_cuda:
        lse_len, seed, offset = state
        # The kernel stores the log-sum-exp padded to its tile size; hand the merged one back in that layout.
        lse = torch.nn.functional.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], -1, -1)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale
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
        out = torch.zeros_like(q_RNQD, dtype=torch.float32)
        lse = torch.full(q_RNQD.shape[:3], float("-inf"), dtype=torch.float32, device=q_RNQD.device)
        states = {}
        for step in range(shard.size):
            src = (shard.rank - step) % shard.size
            incoming = ring.start(kv) if step < shard.size - 1 else None
            for i, call in enumerate(shard.plans[src]):
                rows, q_span, k_span = slice(call.r0, call.r1), slice(call.q0, call.q1), slice(call.k0, call.k1)
                k = _expand_kv(kv[0, rows, :, k_span], num_heads)
                v = _expand_kv(kv[1, rows, :, k_span], num_heads)
                block_out, block_lse, states[src, i] = _block_forward(
                    q_RNQD[rows, :, q_span], k, v, shard.bias(call, q_RNQD.dtype), call.kind == CAUSAL, scale
                )
                del k, v
                # Every query of a call sees at least one key, so `block_lse` is finite; an untouched query's
                # accumulator (-inf, 0) takes the block's values.
                acc_out, acc_lse = out[rows, :, q_span], lse[rows, :, q_span]
                merged = torch.logaddexp(acc_lse, block_lse)
                acc_out.mul_((acc_lse - merged).exp_()[..., None])
                acc_out.add_(block_out.float() * (block_lse - merged).exp_()[..., None])
                acc_lse.copy_(merged)
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
            for i, call in enumerate(shard.plans[src]):
                rows, q_span, k_span = slice(call.r0, call.r1), slice(call.q0, call.q1), slice(call.k0, call.k1)
                k = _expand_kv(kv[0, rows, :, k_span], num_heads)
                v = _expand_kv(kv[1, rows, :, k_span], num_heads)
                dq_, dk_, dv_ = _block_backward(
                    dout[rows, :, q_span],
                    q[rows, :, q_span],
                    k,
                    v,
                    shard.bias(call, q.dtype),
                    call.kind == CAUSAL,
                    out[rows, :, q_span],
                    lse[rows, :, q_span],
                    scale,
                    ctx.states[src, i],
                )
                del k, v
                dq[rows, :, q_span] += dq_
                dkv[0, rows, :, k_span] += _reduce_kv(dk_.float(), num_kv_heads)
                dkv[1, rows, :, k_span] += _reduce_kv(dv_.float(), num_kv_heads)
            # The gradient accumulator travels with its K/V block; after `cp` hops it is back at the block's owner.
            if shard.size > 1:
                dkv = dkv_ring.start(dkv)
                dkv_ring.wait()
            if incoming_kv is not None:
                kv_ring.wait()
                kv = incoming_kv
        return dq.to(q.dtype), dkv[0].to(k_own.dtype), dkv[1].to(v_own.dtype), None, None
