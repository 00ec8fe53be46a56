"""Qwen3-MoE on the shared decoder: Qwen3 attention, token-choice MoE MLP on every `decoder_sparse_step`-th layer."""

from __future__ import annotations

from typing import Any

from prime_models.models.qwen3.modeling_qwen3 import qwen3_attention_args
from prime_models.models.transformer import CausalLM, TransformerArgs


class Qwen3MoeForCausalLM(CausalLM):
    model_type = "qwen3_moe"

    @classmethod
    def args_from_config(cls, cfg: Any) -> TransformerArgs:
        return TransformerArgs(
            **qwen3_attention_args(cfg),
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(getattr(cfg, "mlp_only_layers", None) or []),
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        )
