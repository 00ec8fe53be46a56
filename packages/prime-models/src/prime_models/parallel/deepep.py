"""DeepEP token dispatch (GPU only): the `AllToAllDispatcher` contract through DeepEP's fused NVLink/RDMA kernels.

DeepEP (https://github.com/deepseek-ai/DeepEP) is not on PyPI: it is built from source at v1.2.1, the last release of
the `deep_ep.Buffer` API (benchmarks/build_deepep.sh; docs/scaling.md, "DeepEP"). `deep_ep` is imported when a `DeepEPDispatcher` is built; without it the error says
how to get it.

Differences from the all-to-all path, same function: DeepEP sends each token once per destination rank (not once per
expert), with its top-k expert ids remapped to that rank's local experts (-1 where the expert lives elsewhere) and
its router weights; the receiver expands tokens to (token, local expert) rows, runs the grouped matmul, weights and
sums the rows per token, and `combine` sums the per-rank partial outputs back at the source. Gradients take the
reverse routes (dispatch <-> combine with the same handle), the router weights' included.

Shape legend: T tokens, H hidden, K top-k, M tokens received (one per source token and rank), A (token, local
expert) rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prime_models.parallel.expert_group import ExpertGroup

if TYPE_CHECKING:
    from prime_models.layers.moe import GroupedExperts

DEEPEP_INSTALL_HINT = (
    "model.ep_dispatcher='deepep' needs DeepEP v1.2.1 (`import deep_ep`), built from source with "
    "benchmarks/build_deepep.sh: see docs/scaling.md, section 'DeepEP'. Or use model.ep_dispatcher='torch'."
)


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(DEEPEP_INSTALL_HINT) from e
    return deep_ep


_BUFFERS: dict[Any, Any] = {}
# DeepEP's NUM_MAX_NVL_PEERS: the most ranks its intranode kernels connect.
NVL_PEERS = 8


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int):
    """One `deep_ep.Buffer` per process group, grown when a layer needs more bytes per token than it was sized for."""
    deep_ep = import_deep_ep()
    num_ranks = dist.get_world_size(group)
    nvl_bytes = rdma_bytes = 0
    # Up to NVL_PEERS ranks talk over NVLink alone (the intranode kernels); only larger groups need the RDMA buffer,
    # whose size hint a build without NVSHMEM refuses to give.
    internode = num_ranks > NVL_PEERS
    for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
        nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        if internode:
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    buffer = _BUFFERS.get(group)
    if buffer is None or buffer.num_nvl_bytes < nvl_bytes or buffer.num_rdma_bytes < rdma_bytes:
        buffer = _BUFFERS[group] = deep_ep.Buffer(group, nvl_bytes, rdma_bytes)
    return buffer


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, top_w_TK, top_idx_TK, buffer, layout, state: dict):
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank = layout
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x_TH,
            topk_idx=top_idx_TK,
            topk_weights=top_w_TK,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        state["handle"] = handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx, grad_x_MH, grad_w_MK, _):
        # Each source token gets the sum of its copies' gradients; the weights' gradients come back the same way.
        grad_w = grad_w_MK.float().contiguous() if grad_w_MK is not None else None
        grad_x, grad_w, _ = ctx.buffer.combine(grad_x_MH.contiguous(), ctx.handle, topk_weights=grad_w)
        return grad_x, grad_w, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, buffer, state: dict):
        ctx.buffer, ctx.handle = buffer, state["handle"]
        combined, _, _ = buffer.combine(y_MH, state["handle"])
        return combined

    @staticmethod
    def backward(ctx, grad_TH):
        grad_y, *_ = ctx.buffer.dispatch(grad_TH.contiguous(), handle=ctx.handle)
        return grad_y, None, None


class DeepEPDispatcher(ExpertGroup):
    """Expert-parallel token dispatch through DeepEP's intranode (NVLink) / internode (RDMA) kernels."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        import_deep_ep()
        super().__init__(group, num_experts)

    def __call__(
        self, x_TH: torch.Tensor, top_w_TK: torch.Tensor, top_idx_TK: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        if not x_TH.is_cuda:
            raise ValueError("model.ep_dispatcher='deepep' runs on CUDA tensors only; use 'torch' on CPU")
        # At least 2 bytes per element so one buffer serves bf16 and fp32 activations alike.
        buffer = get_buffer(self.group, x_TH.shape[1] * max(x_TH.element_size(), 2))
        top_idx = top_idx_TK.to(torch.int64).contiguous()
        layout = buffer.get_dispatch_layout(top_idx, self.num_experts)[:4]
        state: dict = {}
        recv_x, recv_w, recv_idx = _Dispatch.apply(
            x_TH.contiguous(), top_w_TK.float().contiguous(), top_idx, buffer, layout, state
        )

        valid_MK = recv_idx >= 0
        expert_A = recv_idx[valid_MK]
        order_A = expert_A.argsort(stable=True)
        token_A = torch.arange(recv_x.shape[0], device=recv_x.device).repeat_interleave(valid_MK.sum(1))[order_A]
        counts_L = torch.bincount(expert_A, minlength=self.num_local)
        out_AH = experts(recv_x[token_A], counts_L)
        out_AH = out_AH * recv_w[valid_MK][order_A, None].to(out_AH.dtype)
        y_MH = torch.zeros_like(recv_x).index_add_(0, token_A, out_AH.to(recv_x.dtype))
        return _Combine.apply(y_MH, buffer, state).to(x_TH.dtype)
