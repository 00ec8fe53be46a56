"""Token-choice mixture of experts: softmax router with top-k, experts run as grouped matmuls.

Tokens are sorted by expert so every expert sees one contiguous slab, then `kernels.grouped_mm` runs all experts in
one call (`torch._grouped_mm`) or, where that kernel is unavailable, loops over the experts that received tokens.

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
        """`x` rows are sorted by expert, `counts[e]` rows per expert."""
        offs = counts_E.cumsum(0).to(torch.int32)
        gate_up = self.grouped_mm(x_AH, self.gate_up_proj.transpose(-2, -1), counts_E, offs)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.grouped_mm(self.act(gate) * up, self.down_proj.transpose(-2, -1), counts_E, offs)

    def grouped_mm(self, x_AK, w_EKN, counts_E, offs_E) -> torch.Tensor:
        # The seam for low-precision experts: prime_models.parallel.fp8 swaps in a subclass overriding this.
        return kernels.grouped_mm(x_AK, w_EKN, counts_E, offs_E)


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

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        shape = x_BSH.shape
        x_TH = x_BSH.reshape(-1, shape[-1])
        num_tokens = x_TH.shape[0]
        probs_TE, top_w_TK, top_idx_TK = self.gate(x_TH)

        flat_expert_A = top_idx_TK.reshape(-1)
        order_A = flat_expert_A.argsort(stable=True)
        token_A = order_A // self.top_k
        counts_E = torch.bincount(flat_expert_A, minlength=self.num_experts)

        out_AH = self.experts(x_TH[token_A], counts_E)
        out_AH = out_AH * top_w_TK.reshape(-1)[order_A, None]
        y_TH = torch.zeros_like(x_TH).index_add_(0, token_A, out_AH.to(x_TH.dtype))

        # Switch-Transformer balance loss: E * sum_e (fraction of tokens routed to e) * (mean router prob of e).
        frac_E = counts_E.to(torch.float32) / max(num_tokens, 1)
        aux = self.num_experts * (frac_E * probs_TE.mean(0)).sum()
        self.last_stats = MoEStats(tokens_per_expert=counts_E.detach(), aux_loss=aux)
        return y_TH.view(shape)
