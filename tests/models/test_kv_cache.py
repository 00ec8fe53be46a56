"""One decoder for training and sampling: the model's own forward over a KV cache (prefill, then batched decode of
sequences at different lengths, slots reused and copied) gives the logits of the full training forward."""

from __future__ import annotations

import pytest
import torch
from prime_models import load_model
from prime_models.layers import KVCache

from tests.models.conftest import VOCAB, tiny_config


def _cache(model, num_slots: int, max_len: int) -> KVCache:
    a = model.args
    return KVCache(a.num_layers, a.num_kv_heads, a.head_dim, num_slots=num_slots, max_len=max_len,
                   dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip


def _next_logits(model, ids_BS, positions_BS, step) -> torch.Tensor:
    return model.lm_head(model.forward_hidden(ids_BS, positions_BS, kv_cache=step)[:, -1])


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_moe"])
@torch.no_grad()
def test_cached_prefill_and_decode_equal_the_full_forward(model_type):
    model = load_model(tiny_config(model_type), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (1, 20), generator=g) for _ in range(3)]
    full = [model(s)[0] for s in seqs]  # [S, V]: logits of the token after each position
    prompt_lens = [7, 4, 7]
    # Slots 2, 0, 1 (not in order, so decode gathers rows); sequence 2 shares sequence 0's prompt through copy_slot.
    seqs[2][:, :7] = seqs[0][:, :7]
    full[2] = model(seqs[2])[0]
    slots = [2, 0, 1]
    cache = _cache(model, num_slots=3, max_len=64)
    for i in (0, 1):
        n = prompt_lens[i]
        step = cache.prefill(torch.tensor([slots[i]]), n)
        logits = _next_logits(model, seqs[i][:, :n], torch.arange(n)[None], step)[0]
        torch.testing.assert_close(logits, full[i][n - 1], atol=1e-5, rtol=1e-5)
    cache.copy_slot(slots[0], slots[2], prompt_lens[0])
    positions = list(prompt_lens)
    for _ in range(12):  # every sequence one token a step, each at its own position
        ids = torch.cat([seqs[i][:, positions[i]] for i in range(3)])[:, None]
        pos_B = torch.tensor(positions)
        step = cache.decode(torch.tensor(slots), pos_B)
        logits = _next_logits(model, ids, pos_B[:, None], step)
        for i in range(3):
            torch.testing.assert_close(logits[i], full[i][positions[i]], atol=1e-5, rtol=1e-5)
        positions = [p + 1 for p in positions]


@torch.no_grad()
def test_contiguous_slots_decode_like_gathered_ones():
    model = load_model(tiny_config("qwen3"), seed=0).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    for slots in ([0, 1], [1, 0]):
        cache = _cache(model, num_slots=2, max_len=16)
        for row, slot in enumerate(slots):
            _next_logits(model, ids[row : row + 1, :8], torch.arange(8)[None], cache.prefill(torch.tensor([slot]), 8))
        pos_B = torch.tensor([8, 8])
        out[tuple(slots)] = _next_logits(model, ids[:, 8:], pos_B[:, None], cache.decode(torch.tensor(slots), pos_B))
    torch.testing.assert_close(out[(0, 1)], out[(1, 0)], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[(0, 1)], model(ids)[:, 8], atol=1e-5, rtol=1e-5)
