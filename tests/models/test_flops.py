from __future__ import annotations

import pytest
from prime_models import ParallelDims, count_params, flops_per_token, load_model

from tests.models.conftest import tiny_config


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen3", True), ("qwen3_moe", False)])
def test_param_counts_match_the_module(model_type, tied):
    cfg = tiny_config(model_type, tie_word_embeddings=tied, attention_bias=model_type == "llama")
    model = load_model(cfg, device="meta")
    counts = count_params(model)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts == count_params(cfg)
    a = model.args
    attn = 12 * a.num_layers * a.num_heads * (a.hidden_size / a.num_heads) * 100
    assert flops_per_token(cfg, 100) == 6 * counts.active_matmul + attn
    if model_type == "qwen3_moe":
        assert counts.active_matmul < counts.total - counts.embedding


def test_parallel_dims_validation():
    assert ParallelDims(world_size=8, dp_replicate=2).dp_shard == 4
    assert ParallelDims(cp=2, world_size=8, dp_replicate=2).dp_shard == 2
    with pytest.raises(ValueError, match="tp>1 arrives with tensor parallelism"):
        ParallelDims(tp=2, world_size=2)
    with pytest.raises(ValueError, match="not divisible by dp_replicate"):
        ParallelDims(cp=3, world_size=4)
    with pytest.raises(ValueError, match="world_size"):
        ParallelDims(dp_shard=3, world_size=4)
