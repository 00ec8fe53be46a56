"""Token-choice mixture of experts: softmax router with top-k, experts run as grouped matmuls.

Tokens are sorted by expert so every expert sees one contiguous slab, then `kernels.grouped_mm` runs all experts in
one call (`torch._grouped_mm`) or, where that kernel is unavailable, loops over the experts that received tokens.

Routing tokens to experts and their outputs back is the job of `MoE.dispatcher`. The default, `LocalDispatcher`, runs
every expert on this device; expert parallelism (`prime_models.parallel.expert_parallel`) swaps in a dispatcher that
sends tokens to the ranks holding their experts, so this file stays single-device code.

Expert weights use HF's fused layout (transformers >= 5): `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`, so FSDP shards along experts.

Shape legend: T tokens, H hidden, E experts, I expert intermediate, A = T*k token-expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prime_models import kernels
from prime_models.layers.common import activation


@dataclass
class MoEStats:
    """Routing statistics of the last forward of one MoE layer."""

    tokens_per_expert: torch.Tensor  # [E] int64, detached
    aux_loss: torch.Tensor  # scalar, differentiable w.r.t. the router; Switch-Transformer load-balancing loss


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = logits_TE.softmax(dim=-1, dtype=torch.float32)
        top_w, top_idx = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs_TE, top_w.to(logits_TE.dtype), top_idx


class GroupedExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.act = activation(act)

    def forward(self, x_AH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """`x` rows are sorted by expert, `counts[e]` rows per expert (one count per expert held here)."""
        gate_up_w, down_w = _local(self.gate_up_proj), _local(self.down_proj)
        if x_AH.shape[0] == 0:
            # Keep input and weights in the graph: under expert parallelism every rank must run the same backward
            # collectives (the all-to-all of input gradients, FSDP's reduce of weight gradients), tokens or not.
            return x_AH.new_zeros(0, down_w.shape[1]) + 0.0 * (x_AH.sum() + gate_up_w.sum() + down_w.sum())
        offs = counts_E.cumsum(0).to(torch.int32)
        gate_up = self.grouped_mm(x_AH, gate_up_w.transpose(-2, -1), counts_E, offs)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.grouped_mm(self.act(gate) * up, down_w.transpose(-2, -1), counts_E, offs)

    def grouped_mm(self, x_AK, w_EKN, counts_E, offs_E) -> torch.Tensor:
        # The seam for low-precision experts: prime_models.quantization.float8 swaps in a subclass overriding this.
        return kernels.grouped_mm(x_AK, w_EKN, counts_E, offs_E)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Under expert parallelism the weights are DTensors sharded over experts and the dispatcher hands this module only
    # tokens of the experts held here, so the local shard is the whole computation.
    return weight.to_local() if hasattr(weight, "to_local") else weight


def sort_by_expert(top_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-expert assignments grouped by expert: (order into the flat assignments, token of each, count per expert)."""
    flat_expert_A = top_idx_TK.reshape(-1)
    order_A = flat_expert_A.argsort(stable=True)
    return order_A, order_A // top_idx_TK.shape[1], torch.bincount(flat_expert_A, minlength=num_experts)


class LocalDispatcher:
    """Runs every expert on this device: sort token-expert assignments by expert, one grouped matmul, scatter back."""

    def __call__(
        self, x_TH: torch.Tensor, top_w_TK: torch.Tensor, top_idx_TK: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        order_A, token_A, counts_E = sort_by_expert(top_idx_TK, experts.num_experts)
        out_AH = experts(x_TH[token_A], counts_E)
        out_AH = out_AH * top_w_TK.reshape(-1)[order_A, None]
        return torch.zeros_like(x_TH).index_add_(0, token_A, out_AH.to(x_TH.dtype))


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = False,
        act: str = "silu",
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.gate = Router(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(hidden_size, intermediate_size, num_experts, act)
        self.num_experts, self.top_k = num_experts, top_k
        self.last_stats: MoEStats | None = None
        # Replaced by prime_models.parallel.apply_expert_parallel; not a module, so it never appears in state dicts.
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        shape = x_BSH.shape
        x_TH = x_BSH.reshape(-1, shape[-1])
        num_tokens = x_TH.shape[0]
        probs_TE, top_w_TK, top_idx_TK = self.gate(x_TH)
        y_TH = self.dispatcher(x_TH, top_w_TK, top_idx_TK, self.experts)

        counts_E = torch.bincount(top_idx_TK.reshape(-1), minlength=self.num_experts)
        # Switch-Transformer balance loss: E * sum_e (fraction of tokens routed to e) * (mean router prob of e).
        frac_E = counts_E.to(torch.float32) / max(num_tokens, 1)
        aux = self.num_experts * (frac_E * probs_TE.mean(0)).sum()
        self.last_stats = MoEStats(tokens_per_expert=counts_E.detach(), aux_loss=aux)
        return y_TH.view(shape)
