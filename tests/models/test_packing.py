"""Packed rows: several samples per row, position_ids restart at 0, no attention across samples."""

from __future__ import annotations

import pytest
import torch
from prime_models import apply_activation_checkpointing, load_model
from prime_models.layers.attention import build_attention_metadata, cu_seqlens_from_position_ids

from tests.models.conftest import VOCAB, tiny_config


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    cu, max_len = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 5, 6, 10, 12] and cu.dtype == torch.int32 and max_len == 4
    assert build_attention_metadata(torch.arange(6).expand(2, 6), "sdpa").mask_B1SS is None


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_moe"])
def test_packed_row_equals_separate_forwards(model_type):
    model = load_model(tiny_config(model_type), seed=0)
    lengths = [5, 9, 7]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    packed_ids = torch.cat(samples, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(packed_ids, position_ids)
        separate = torch.cat([model(s) for s in samples], dim=1)
    diff = (packed - separate).abs().max().item()
    print(f"{model_type}: packed vs separate max diff = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("mode,every", [("full", 1), ("selective", 2), ("selective", 0)])
def test_activation_checkpointing_keeps_gradients(mode, every):
    cfg = tiny_config("qwen3_moe")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ref_model, ac_model = load_model(cfg, seed=0), load_model(cfg, seed=0)
    apply_activation_checkpointing(ac_model.model.layers, mode, every)
    for m in (ref_model, ac_model):
        lp, _ = m(ids[:, :-1], targets=ids[:, 1:])
        (-lp.mean()).backward()
    for (name, p), q in zip(ref_model.named_parameters(), ac_model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    with pytest.raises(ValueError):
        apply_activation_checkpointing(ac_model.model.layers, "sometimes")
