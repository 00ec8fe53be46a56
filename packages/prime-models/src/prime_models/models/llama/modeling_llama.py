"""Llama (2/3.x) on the shared decoder: no q/k norm, optional attention/MLP biases."""

from __future__ import annotations

from typing import Any

from prime_models.models.transformer import CausalLM, TransformerArgs


class LlamaForCausalLM(CausalLM):
    model_type = "llama"

    @classmethod
    def args_from_config(cls, cfg: Any) -> TransformerArgs:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return TransformerArgs(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            hidden_act=cfg.hidden_act,
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            initializer_range=getattr(cfg, "initializer_range", 0.02),
            pad_token_id=getattr(cfg, "pad_token_id", None),
        )
