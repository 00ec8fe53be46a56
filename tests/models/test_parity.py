"""Numerical parity with transformers and lossless HF round trips."""

from __future__ import annotations

import json

import prime_models
import pytest
import torch
from prime_models import get_model_spec, hf_state_dict, load_model, save_hf

from tests.models.conftest import VOCAB, save_tiny_hf, tiny_config


def _hf_logits(path, input_ids):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf.eval()(input_ids).logits


def _input_ids(batch=2, seq=24, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(hf_dir, model_type):
    ids = _input_ids()
    model = load_model(hf_dir)
    with torch.no_grad():
        ours = model(ids)
    ref = _hf_logits(hf_dir, ids)
    diff = (ours - ref).abs().max().item()
    print(f"{model_type}: max |logits - HF| = {diff:.2e}")
    assert ours.shape == (2, 24, VOCAB)
    assert diff < 1e-5


def test_save_hf_reopens_in_transformers_and_round_trips(hf_dir, model_type, tmp_path):
    ids = _input_ids(seed=2)
    model = load_model(hf_dir)
    out = tmp_path / "saved"
    # A tiny shard limit forces several shards plus an index.
    save_hf(model, out, max_shard_size="20KB")
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "generation_config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    assert not [f for f in files if f.endswith(".tmp")]
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type

    with torch.no_grad():
        ours = model(ids)
    diff = (ours - _hf_logits(out, ids)).abs().max().item()
    print(f"{model_type}: save_hf -> transformers max diff = {diff:.2e}")
    assert diff < 1e-5

    reloaded = load_model(out)
    a, b = dict(hf_state_dict(model)), dict(hf_state_dict(reloaded))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for (ka, ta), (kb, tb) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(ta, tb)


def test_hf_state_dict_matches_transformers_checkpoint_keys(hf_dir):
    from safetensors.torch import load_file

    model = load_model(hf_dir)
    ours = dict(hf_state_dict(model))
    theirs = load_file(hf_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_tied_embeddings_qwen3(tmp_path):
    path = tmp_path / "tied"
    save_tiny_hf("qwen3", path, tie_word_embeddings=True)
    model = load_model(path)
    assert model.lm_head_weight is model.model.embed_tokens.weight
    ids = _input_ids()
    with torch.no_grad():
        assert (model(ids) - _hf_logits(path, ids)).abs().max() < 1e-5
    save_hf(model, tmp_path / "tied_out")
    assert "lm_head.weight" not in dict(hf_state_dict(model))
    with torch.no_grad():
        assert (model(ids) - _hf_logits(tmp_path / "tied_out", ids)).abs().max() < 1e-5


def test_random_init_from_config_dict_and_dir(tmp_path):
    cfg = tiny_config("qwen3_moe")
    a = load_model(cfg.to_dict(), seed=3)
    b = load_model(cfg, seed=3)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(cfg.to_json_string())
    c = load_model(tmp_path / "cfg", seed=3)
    for (k, ta), tb, tc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(ta, tb) and torch.equal(ta, tc), k
    assert a.model.layers[0].mlp.experts.gate_up_proj.std() > 0


def test_bf16_and_meta_loading(hf_dir):
    model = load_model(hf_dir, dtype=torch.bfloat16)
    assert model.lm_head_weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model(_input_ids()).dtype == torch.bfloat16
    meta = load_model(hf_dir, device="meta")
    assert meta.lm_head_weight.is_meta


def test_unknown_model_type_lists_known_types(tmp_path):
    with pytest.raises(ValueError, match="known model types: llama, qwen3, qwen3_moe"):
        get_model_spec("gpt2")
    with pytest.raises(ValueError, match="llama, qwen3, qwen3_moe"):
        load_model({"model_type": "mamba"})


def test_attn_choices():
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="unknown attn"):
        load_model(cfg, attn="xformers")
    if not prime_models.kernels.HAS_FLASH_ATTN:
        with pytest.raises(ValueError, match=r"pip install prime-models\[flash-attn\]"):
            load_model(cfg, attn="flash_attn")
    assert load_model(cfg, attn="auto").attn_backend == "sdpa"


def test_moe_grouped_mm_fallback_and_router_stats(tmp_path, monkeypatch):
    path = tmp_path / "moe"
    save_tiny_hf("qwen3_moe", path)
    model = load_model(path)
    ids = _input_ids()
    with torch.no_grad():
        fast = model(ids)
        monkeypatch.setattr(prime_models.kernels, "FORCE_GROUPED_MM_FALLBACK", True)
        slow = model(ids)
    assert (fast - slow).abs().max() < 1e-5
    stats = model.router_stats()
    assert len(stats) == 2
    assert all(int(s.tokens_per_expert.sum()) == ids.numel() * 2 for s in stats)
    model(ids)
    aux = model.moe_aux_loss()
    assert aux.requires_grad and aux.item() >= 1.0 - 1e-4  # the Switch loss is >= 1, == 1 when perfectly balanced
    aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_native_gqa_matches_expanded_kv(monkeypatch):
    """On CUDA, unmasked SDPA runs with `enable_gqa=True` by default; it must give the step that expanding K/V to
    every query head gives (bf16, Qwen3-0.6B's head layout: 16 query heads over 8 kv heads of 128)."""
    from prime_models import kernels

    seq = 8192
    cfg = tiny_config("qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=4, max_position_embeddings=seq + 1)  # fmt: skip
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for native in (True, False):
        monkeypatch.setattr(kernels, "SDPA_NATIVE_GQA", native)
        model = load_model(cfg, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
        logprobs, _ = model(ids[:, :-1], None, targets=ids[:, 1:])
        (-logprobs.float().mean()).backward()
        runs[native] = logprobs.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}
    (lp, grads), (lp_ref, grads_ref) = runs[True], runs[False]
    worst = max(((grads[n] - grads_ref[n]).norm() / grads_ref[n].norm()).item() for n in grads_ref)
    print(
        f"native GQA vs expanded K/V: max |logprob diff| {(lp - lp_ref).abs().max().item():.2e}, "
        f"worst relative grad diff {worst:.2e}"
    )
    assert (lp - lp_ref).abs().max().item() < 5e-2
    assert worst < 1e-2
