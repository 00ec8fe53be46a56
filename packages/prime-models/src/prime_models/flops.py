"""Parameter counts and FLOPs per token for the trainer's MFU metric.

Convention (prime-rl / torchtitan): `flops_per_token = 6 * N + 12 * L * heads * (hidden / heads) * seq_len`, where N
counts the *active* matmul parameters per token (attention and MLP projections, the top-k experts and router of MoE
layers, and the LM head) and excludes the embedding lookup and norms. The second term is the attention score/value
matmuls, forward + backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prime_models.models.transformer import TransformerArgs


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter (tied embeddings counted once)
    active_matmul: int  # matmul parameters one token passes through
    embedding: int


def _args(model_or_config: Any) -> TransformerArgs:
    if isinstance(model_or_config, TransformerArgs):
        return model_or_config
    if hasattr(model_or_config, "args") and isinstance(model_or_config.args, TransformerArgs):
        return model_or_config.args
    from prime_models.loading import resolve_config
    from prime_models.registry import get_model_spec

    hf_config, _ = resolve_config(model_or_config)
    return get_model_spec(hf_config.model_type).model_cls.args_from_config(hf_config)


def count_params(model_or_config: Any) -> ParamCounts:
    """Analytic counts from the architecture, so they are right for meta-device or FSDP-sharded models too."""
    a = _args(model_or_config)
    h, d = a.hidden_size, a.head_dim
    attn = h * a.num_heads * d * 2 + h * a.num_kv_heads * d * 2
    attn_bias = (a.num_heads * d + 2 * a.num_kv_heads * d + h) if a.attention_bias else 0
    norms = 2 * h + (2 * d if a.qk_norm else 0)
    dense_mlp = 3 * h * a.intermediate_size
    dense_bias = (2 * a.intermediate_size + h) if a.mlp_bias else 0
    total = active = 0
    for i in range(a.num_layers):
        total += attn + attn_bias + norms
        active += attn
        if a.is_moe_layer(i):
            expert = 3 * h * a.moe_intermediate_size
            router = a.num_experts * h
            total += a.num_experts * expert + router
            active += a.num_experts_per_tok * expert + router
        else:
            total += dense_mlp + dense_bias
            active += dense_mlp
    embedding = a.vocab_size * h
    head = a.vocab_size * h
    total += embedding + h + (0 if a.tie_word_embeddings else head)
    active += head
    return ParamCounts(total=total, active_matmul=active, embedding=embedding)


def attention_flops_per_token(model_or_config: Any, seq_len: int) -> float:
    a = _args(model_or_config)
    return 12.0 * a.num_layers * a.num_heads * (a.hidden_size / a.num_heads) * seq_len


def flops_per_token(model_or_config: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    return 6.0 * count_params(model_or_config).active_matmul + attention_flops_per_token(model_or_config, seq_len)
