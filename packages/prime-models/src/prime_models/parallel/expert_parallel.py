"""Expert parallelism: each rank of an `ep` group holds `E / ep` experts; tokens travel to them with all-to-all.

`apply_expert_parallel` turns each MoE layer's expert weights into DTensors sharded on the expert dim over the `ep`
mesh (so DCP checkpoints and `hf_state_dict` see, and gather, the full `[E, ...]` tensors) and swaps the layer's
dispatcher:

* ``torch``: `AllToAllDispatcher`, `torch.distributed` all-to-all (any backend: NCCL on GPU, gloo on CPU).
* ``deepep``: `prime_models.parallel.deepep.DeepEPDispatcher`, DeepEP's fused NVLink/RDMA kernels (GPU only).

Both compute the same function as the single-device `LocalDispatcher`. Routing (the router's softmax/top-k) is
replicated; only the expert matmuls are split.

Shape legend: T tokens, H hidden, K top-k, E experts (global), L local experts (E / ep), P ep ranks, A = T*K
token-expert assignments sent, R assignments received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from prime_models.layers.moe import MoE, sort_by_expert
from prime_models.parallel.expert_group import ExpertGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from prime_models.layers.moe import GroupedExperts

DISPATCHERS = ("torch", "deepep")


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable `all_to_all_single` (its backward is the reverse all-to-all of the gradients)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty(sum(output_splits), *x.shape[1:])
    return all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)


def source_major_to_expert_major(counts_PL: torch.Tensor) -> torch.Tensor:
    """Permutation turning rows grouped by (source rank, local expert) into rows grouped by (local expert, source).

    `counts_PL[p, l]` rows came from rank p for local expert l; the grouped matmul needs each expert's rows together.
    """
    num_ranks, num_local = counts_PL.shape
    segment_R = torch.repeat_interleave(torch.arange(counts_PL.numel(), device=counts_PL.device), counts_PL.reshape(-1))
    source_R, expert_R = segment_R // num_local, segment_R % num_local
    return (expert_R * num_ranks + source_R).argsort(stable=True)


class AllToAllDispatcher(ExpertGroup):
    """Token dispatch over an expert-parallel process group with `torch.distributed` all-to-all.

    1. sort this rank's token-expert assignments by expert (experts are laid out rank-major, so this also groups them
       by destination rank) and exchange per-expert counts;
    2. all-to-all the token rows; regroup the received rows by local expert; one grouped matmul;
    3. undo the regrouping, all-to-all the outputs back, weight them by the router and sum them into their tokens.
    """

    def __call__(
        self, x_TH: torch.Tensor, top_w_TK: torch.Tensor, top_idx_TK: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        order_A, token_A, counts_E = sort_by_expert(top_idx_TK, self.num_experts)
        recv_counts_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_E, counts_E, group=self.group)
        recv_counts_PL = recv_counts_E.view(self.num_ranks, self.num_local)
        # One host sync per layer: all-to-all needs the split sizes on the host.
        splits = torch.stack([counts_E.view(self.num_ranks, self.num_local).sum(1), recv_counts_PL.sum(1)]).tolist()
        send_splits, recv_splits = splits

        x_RH = all_to_all(x_TH[token_A], recv_splits, send_splits, self.group)
        perm_R = source_major_to_expert_major(recv_counts_PL)
        out_RH = experts(x_RH[perm_R], recv_counts_PL.sum(0))
        out_RH = torch.empty_like(out_RH).index_copy(0, perm_R, out_RH)
        out_AH = all_to_all(out_RH, send_splits, recv_splits, self.group)

        out_AH = out_AH * top_w_TK.reshape(-1)[order_A, None]
        return torch.zeros_like(x_TH).index_add_(0, token_A, out_AH.to(x_TH.dtype))


def make_dispatcher(kind: str, group: dist.ProcessGroup, num_experts: int):
    if kind == "torch":
        return AllToAllDispatcher(group, num_experts)
    if kind == "deepep":
        from prime_models.parallel.deepep import DeepEPDispatcher

        return DeepEPDispatcher(group, num_experts)
    raise ValueError(f"unknown expert dispatcher {kind!r}; known: {DISPATCHERS}")


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatcher: str = "torch") -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (rank r keeps experts `[r*E/ep, (r+1)*E/ep)`) in place.

    The model must hold the same full weights on every rank (as `load_model` with a seed or a checkpoint gives).
    """
    from torch.distributed.tensor import DTensor, Shard

    num_ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not moe_layers:
        raise ValueError(f"ep={num_ranks} needs an MoE model, but {type(model).__name__} has no MoE layers")
    for moe in moe_layers:
        if moe.num_experts % num_ranks:
            raise ValueError(f"ep={num_ranks} must divide the number of experts ({moe.num_experts})")
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            local = param.detach().chunk(num_ranks, dim=0)[rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = make_dispatcher(dispatcher, ep_mesh.get_group(), moe.num_experts)
    return model
