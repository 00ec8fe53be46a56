"""Layers shared by every family: norms, rotary embeddings, attention, dense MLP and MoE."""

from prime_models.layers.attention import Attention, AttentionMetadata, build_attention_metadata
from prime_models.layers.common import MLP, RMSNorm, RotaryEmbedding, apply_rotary
from prime_models.layers.kv_cache import KVCache, KVCacheStep
from prime_models.layers.moe import MoE, MoEStats

__all__ = [
    "MLP",
    "Attention",
    "AttentionMetadata",
    "KVCache",
    "KVCacheStep",
    "MoE",
    "MoEStats",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "build_attention_metadata",
]
