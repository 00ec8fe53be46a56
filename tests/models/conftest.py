"""Tiny random HF checkpoints for the prime-models tests (built locally, nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

VOCAB = 128


def tiny_config(model_type: str, **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**{**common, **overrides})
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, **overrides})
    elif model_type == "qwen3_moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
        cfg = transformers.Qwen3MoeConfig(**{**common, **moe, **overrides})
    else:
        raise ValueError(model_type)
    return cfg


def gpu_attention_config():
    """Small Qwen3 layers with Qwen3-0.6B's attention (GQA, 16 query and 8 kv heads of 128) for the GPU kernel tests."""
    return tiny_config("qwen3", hidden_size=512, intermediate_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)  # fmt: skip


def rows_of_short_samples(rows: int = 4, seq: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of ``seq + 1`` tokens packed with samples of 16-400 tokens: (ids, position_ids), on the host."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    positions = torch.zeros(rows, seq + 1, dtype=torch.long)
    for r in range(rows):
        pos = 0
        while pos < seq + 1:
            n = min(int(torch.randint(16, 400, (1,), generator=g)), seq + 1 - pos)
            positions[r, pos : pos + n] = torch.arange(n)
            pos += n
    return ids, positions


def save_tiny_hf(model_type: str, path, seed: int = 0, **overrides):
    """Random HF model saved with transformers itself; returns the HF model (fp32, eager attention)."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    # HF inits norms to ones; perturb them so the parity test also checks that norm weights are loaded.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(params=["qwen3", "llama", "qwen3_moe"])
def model_type(request):
    return request.param


@pytest.fixture
def hf_dir(tmp_path, model_type):
    path = tmp_path / f"hf_{model_type}"
    save_tiny_hf(model_type, path)
    return path
