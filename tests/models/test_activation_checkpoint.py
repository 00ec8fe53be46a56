"""Activation checkpointing is applied to a model from outside: which layers each mode checkpoints, and what they
keep. Gradients under each mode are checked in test_packing.py, the long-row knobs in test_chunked_mlp.py and
test_attention_offload.py."""

from __future__ import annotations

import pytest
from prime_core.config.trainer import ParallelConfig
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models.parallel.activation_checkpoint import ATTENTION_OPS, MATMUL_OPS, layer_checkpoint

from tests.models.conftest import tiny_config


def _checkpointed(model) -> list[bool]:
    return [layer_checkpoint(layer) is not None for layer in model.model.layers]


@pytest.mark.parametrize(
    "ac,every,expected",
    [
        ("none", 0, [False] * 6),
        ("full", 0, [True] * 6),
        ("selective", 2, [True, False, True, False, True, False]),
        ("selective", 3, [True, False, False, True, False, False]),
        ("selective", 0, [True] * 6),
    ],
)
def test_the_trainer_config_reaches_every_kth_layer(ac, every, expected):
    """``parallel.ac`` and ``parallel.ac_every`` as the trainer passes them to the family's parallelize function."""
    parallel = ParallelConfig(ac=ac, ac_every=every)
    model = load_model(tiny_config("qwen3", num_hidden_layers=6), seed=0)
    names = [name for name, _ in model.named_parameters()]
    get_model_spec("qwen3").parallelize_fn(
        model, ParallelDims(world_size=1), ac=parallel.ac, ac_every=parallel.ac_every
    )
    assert _checkpointed(model) == expected
    assert [name for name, _ in model.named_parameters()] == names  # conversion, LoRA and checkpoints see no wrapper
    for layer, on in zip(model.model.layers, expected, strict=True):
        assert type(layer).__name__.startswith("Checkpointed") == on


def test_selective_every_layer_keeps_attention_and_matmuls_full_keeps_nothing():
    selective = load_model(tiny_config("qwen3"), seed=0)
    get_model_spec("qwen3").parallelize_fn(selective, ParallelDims(world_size=1), ac="selective", ac_every=0)
    assert all(layer_checkpoint(layer).save_ops == ATTENTION_OPS | MATMUL_OPS for layer in selective.model.layers)
    full = load_model(tiny_config("qwen3"), seed=0)
    get_model_spec("qwen3").parallelize_fn(full, ParallelDims(world_size=1), ac="full")
    assert all(layer_checkpoint(layer).save_ops == frozenset() for layer in full.model.layers)


def test_every_needs_selective():
    with pytest.raises(ValueError, match="ac_every"):
        ParallelConfig(ac="full", ac_every=2)
