"""LoRA injection: only adapters train, merged weights equal base + scale * B @ A, PEFT-format round trips."""

from __future__ import annotations

import json

import pytest
import torch
from prime_models import load_model, save_hf
from prime_models import lora as L

from tests.models.conftest import VOCAB, tiny_config

SPEC = L.LoRASpec(rank=4, alpha=8.0)


def _model(model_type: str = "qwen3", seed: int = 0):
    return load_model(tiny_config(model_type), seed=seed)


def _ids(seed: int = 1, rows: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _train(model, steps: int = 3, lr: float = 1e-2, seed: int = 1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    for i in range(steps):
        ids = _ids(seed + i)
        logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
        (-logprobs.mean()).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_moe"])
def test_only_adapters_train_and_base_stays_bitwise(model_type):
    model = _model(model_type)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = L.apply_lora(model, SPEC)
    args = model.args
    dense_layers = sum(not args.is_moe_layer(i) for i in range(args.num_layers))
    assert len(adapted) == 4 * args.num_layers + 3 * dense_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(L.is_adapter_param(n) for n in trainable)
    h, q, kv, inter = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, 64
    per_layer_attn = SPEC.rank * ((h + q) + 2 * (h + kv) + (q + h))
    per_layer_mlp = SPEC.rank * (2 * (h + inter) + (inter + h))
    expected = args.num_layers * per_layer_attn + dense_layers * per_layer_mlp
    assert sum(model.get_parameter(n).numel() for n in trainable) == expected

    # A fresh adapter is a no-op (B = 0).
    ids = _ids()
    fresh = _model(model_type)
    torch.testing.assert_close(model(ids), fresh(ids), rtol=0, atol=0)

    _train(model)
    after = model.state_dict()
    for k, v in base.items():
        assert torch.equal(after[k], v), f"base parameter {k} changed"
    assert any(after[n].abs().sum() > 0 for n in trainable if ".lora_B." in n)


def _manual_merge(base_model, lora_model, adapter: str) -> None:
    layers = L.lora_layers(lora_model)
    with torch.no_grad():
        for name, layer in layers.items():
            if adapter not in layer.lora_A:
                continue
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            base_model.get_submodule(name).weight.add_(layer.scaling[adapter] * (b @ a))


def test_merged_logits_equal_base_plus_scaled_ba():
    model = _model()
    L.apply_lora(model, SPEC)
    _train(model)
    ids = _ids(seed=9)
    lora_logits = model(ids)

    merged = _model()
    _manual_merge(merged, model, "default")
    diff = (merged(ids) - lora_logits).abs().max().item()
    assert diff < 1e-6, diff

    # In-place merge gives the same logits, and unmerge restores the base model.
    base_logits = _model()(ids)
    L.merge_adapter(model, "default")
    assert (model(ids) - lora_logits).abs().max().item() < 1e-6
    L.unmerge_adapter(model)
    with L.use_adapter(model, None):
        assert (model(ids) - base_logits).abs().max().item() < 1e-6
    assert (model(ids) - lora_logits).abs().max().item() < 1e-6


def test_save_hf_merged_matches_adapter_model(tmp_path):
    model = _model()
    L.apply_lora(model, SPEC)
    _train(model)
    save_hf(model, tmp_path / "merged", lora_adapter="default")
    save_hf(model, tmp_path / "base")
    ids = _ids(seed=4)
    merged = load_model(tmp_path / "merged")
    assert (merged(ids) - model(ids)).abs().max().item() < 1e-6
    base = load_model(tmp_path / "base")
    torch.testing.assert_close(base(ids), _model()(ids), rtol=0, atol=0)


def test_peft_directory_round_trip(tmp_path):
    model = _model()
    L.apply_lora(model, SPEC, adapters=["run-a"])
    _train(model)
    L.save_adapter(model, "run-a", tmp_path / "adapter", base_model="tiny")
    cfg = json.loads((tmp_path / "adapter" / L.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["base_model_name_or_path"] == "tiny"
    assert set(cfg["target_modules"]) == set(L.DEFAULT_TARGET_MODULES)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter" / L.ADAPTER_WEIGHTS))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * len(L.lora_layers(model))

    served = _model()
    L.load_adapter(served, "served", tmp_path / "adapter")
    ids = _ids(seed=5)
    with L.use_adapter(served, "served"):
        torch.testing.assert_close(served(ids), model(ids), rtol=0, atol=0)
    assert not any(p.requires_grad for n, p in served.named_parameters() if L.is_adapter_param(n))


def test_peft_loads_our_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    from tests.models.conftest import save_tiny_hf

    hf = save_tiny_hf("qwen3", tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    L.apply_lora(model, SPEC)
    _train(model)
    L.save_adapter(model, "default", tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = _ids(seed=6)
    assert (peft_model(ids).logits - model(ids)).abs().max().item() < 1e-5
    del hf


def test_row_adapters_match_per_adapter_forwards():
    model = _model()
    L.apply_lora(model, SPEC, adapters=["a", "b"])
    for name in ("a", "b"):  # give both adapters distinct, non-zero updates
        L.set_active_adapter(model, name)
        _train(model, steps=2, seed=10 if name == "a" else 20)
    ids = _ids(seed=7, rows=3)
    expected = []
    for row, name in enumerate(["a", None, "b"]):
        with L.use_adapter(model, name):
            expected.append(model(ids[row : row + 1]))
    L.set_row_adapters(model, ["a", None, "b"])
    mixed = model(ids)
    L.set_row_adapters(model, None)
    torch.testing.assert_close(mixed, torch.cat(expected), rtol=1e-6, atol=1e-6)


def test_training_one_adapter_leaves_the_other_unchanged():
    model = _model()
    L.apply_lora(model, SPEC, adapters=["a", "b"])
    b_before = [p.clone() for p in L.adapter_parameters(model, "b")]
    a_before = [p.clone() for p in L.adapter_parameters(model, "a")]
    L.set_active_adapter(model, "a")
    opt = torch.optim.AdamW(L.adapter_parameters(model, "a"), lr=1e-2)
    for i in range(2):
        ids = _ids(seed=30 + i)
        logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
        (-logprobs.mean()).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(L.adapter_parameters(model, "b"), b_before, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(L.adapter_parameters(model, "a"), a_before, strict=True))
    # Adapter b never saw a forward, so it has no gradient either.
    assert all(p.grad is None for p in L.adapter_parameters(model, "b"))


def test_seeded_init_is_reproducible_and_targets_are_respected():
    m1, m2 = _model(), _model()
    spec = L.LoRASpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj"))
    assert L.apply_lora(m1, spec, seed=5) == L.apply_lora(m2, spec, seed=5)
    assert sorted(L.lora_layers(m1)) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    )
    for p, q in zip(L.adapter_parameters(m1, "default"), L.adapter_parameters(m2, "default"), strict=True):
        assert torch.equal(p, q)


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="rank"):
        L.LoRASpec(rank=0)
    with pytest.raises(ValueError, match="no linear layer"):
        L.apply_lora(_model(), L.LoRASpec(target_modules=("nonexistent",)))
    with pytest.raises(ValueError, match="exceeds"):
        L.apply_lora(_model(), L.LoRASpec(rank=33))
    with pytest.raises(ValueError, match="adapter name"):
        L.apply_lora(_model(), SPEC, adapters=["bad name"])
    model = _model()
    L.apply_lora(model, SPEC)
    with pytest.raises(ValueError, match="already exists"):
        L.add_adapter(model, "default", SPEC)


def test_load_adapter_rejects_mismatched_shapes(tmp_path):
    model = _model()
    L.apply_lora(model, SPEC)
    L.save_adapter(model, "default", tmp_path / "adapter")
    other = load_model(tiny_config("qwen3", hidden_size=48, head_dim=12))
    with pytest.raises(ValueError, match="expects"):
        L.load_adapter(other, "x", tmp_path / "adapter")


def test_lora_config_validation():
    from prime_core.config.shared import ModelConfig
    from pydantic import ValidationError

    cfg = ModelConfig.model_validate({"lora": {}}).lora
    assert (cfg.rank, cfg.alpha, cfg.adapter_name) == (16, 32.0, "r16-a32")
    assert L.LoRASpec.from_config(cfg).target_modules == L.DEFAULT_TARGET_MODULES
    for bad, field in [({"rank": 0}, "rank"), ({"target_modules": ["q_proj", "fc1"]}, "target_modules"),
                       ({"target_modules": []}, "target_modules"), ({"dropout": 1.0}, "dropout"),
                       ({"name": "has space"}, "name")]:  # fmt: skip
        with pytest.raises(ValidationError, match=field):
            ModelConfig.model_validate({"lora": bad})
