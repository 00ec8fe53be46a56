"""Qwen3 dense on the shared decoder: per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from prime_models.models.transformer import CausalLM, TransformerArgs


def _check_no_sliding_window(cfg: Any) -> None:
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


def qwen3_attention_args(cfg: Any) -> dict:
    _check_no_sliding_window(cfg)
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=cfg.hidden_act,
        qk_norm=True,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )


class Qwen3ForCausalLM(CausalLM):
    model_type = "qwen3"

    @classmethod
    def args_from_config(cls, cfg: Any) -> TransformerArgs:
        return TransformerArgs(**qwen3_attention_args(cfg))
