"""Qwen3-VL: parity with transformers (text and images, fp32), lossless HF round trip, MRoPE positions, packing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from prime_core.vision import mrope_positions, packed_mrope_positions
from prime_models import hf_state_dict, load_model, save_hf
from prime_models.tiny import tiny_qwen3_vl_config

PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal patch * patch * patch


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A random Qwen3-VL saved by transformers, with perturbed norms so the test also checks they are loaded."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3_vl")
    hf.save_pretrained(path)
    return path


def _hf(path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _image_sample(grids, cfg, seed=0, text=(5, 6)):
    """Token ids with each image as <vision_start> placeholders <vision_end> between text, and random pixels."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(text)
    for t, h, w in grids:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id]
        ids += torch.randint(0, 200, (3,), generator=gen).tolist()
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    return torch.tensor(ids), pixels, grid


def test_text_logits_match_transformers(vl_dir):
    ids = torch.randint(0, 280, (2, 24), generator=torch.Generator().manual_seed(1))
    model = load_model(vl_dir)
    with torch.no_grad():
        diff = (model(ids) - _hf(vl_dir)(ids).logits).abs().max().item()
    print(f"qwen3_vl text: max |logits - HF| = {diff:.2e}")
    assert diff < 1e-5


def test_image_logits_match_transformers(vl_dir):
    cfg = tiny_qwen3_vl_config()
    # Two images of different shapes (non-square grids exercise the position-table resampling and 3D positions).
    ids, pixels, grid = _image_sample([(1, 8, 12), (1, 6, 4)], cfg)
    ids = ids[None]
    model = load_model(vl_dir)
    with torch.no_grad():
        ours = model(ids, pixel_values=pixels, image_grid_thw=grid)
        ref = _hf(vl_dir)(
            ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == cfg.image_token_id).int()
        ).logits
    diff = (ours - ref).abs().max().item()
    print(f"qwen3_vl text+image: max |logits - HF| = {diff:.2e} (logits up to {ref.abs().max():.2f})")
    assert diff < 1e-5


def test_mrope_positions_match_transformers_rope_index(vl_dir):
    cfg = tiny_qwen3_vl_config()
    ids, _, grid = _image_sample([(1, 8, 12), (1, 4, 4)], cfg)
    hf = _hf(vl_dir)
    ref, _ = hf.model.get_rope_index(ids[None], (ids[None] == cfg.image_token_id).int(), image_grid_thw=grid)
    ours = mrope_positions(ids.numpy(), cfg.image_token_id, grid.numpy(), 2)
    assert np.array_equal(ours, ref[:, 0].numpy())
    with pytest.raises(ValueError, match="consecutive placeholder"):
        mrope_positions(ids[:10].numpy(), cfg.image_token_id, grid.numpy(), 2)


def test_save_load_round_trip_is_bit_identical(vl_dir, tmp_path):
    cfg = tiny_qwen3_vl_config()
    model = load_model(vl_dir)
    out = tmp_path / "saved"
    save_hf(model, out, max_shard_size="40KB")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3VLForConditionalGeneration"]
    from safetensors.torch import load_file

    theirs = load_file(vl_dir / "model.safetensors")
    ours = dict(hf_state_dict(model))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    reloaded = load_model(out)
    for (ka, ta), (kb, tb) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(ta, tb), ka
    ids, pixels, grid = _image_sample([(1, 4, 8)], cfg)
    with torch.no_grad():
        a = model(ids[None], pixel_values=pixels, image_grid_thw=grid)
        b = _hf(out)(ids[None], pixel_values=pixels, image_grid_thw=grid,
                     mm_token_type_ids=(ids[None] == cfg.image_token_id).int()).logits  # fmt: skip
    assert (a - b).abs().max() < 1e-5


def test_packed_multimodal_row_equals_separate_forwards(vl_dir):
    """Three samples (two with images, one text-only) in one row: logits and log-probs equal separate forwards."""
    cfg = tiny_qwen3_vl_config()
    model = load_model(vl_dir)
    samples = [
        _image_sample([(1, 4, 8)], cfg, seed=1),
        (torch.randint(0, 200, (9,), generator=torch.Generator().manual_seed(2)), None, None),
        _image_sample([(1, 4, 4), (1, 8, 4)], cfg, seed=3),
    ]
    ids = torch.cat([s[0] for s in samples])
    pos = torch.cat([torch.arange(len(s[0])) for s in samples])
    pad = 7
    ids = torch.cat([ids, torch.zeros(pad, dtype=torch.long)])[None]
    pos = torch.cat([pos, torch.arange(pad)])[None]
    pixels = torch.cat([s[1] for s in samples if s[1] is not None])
    grid = torch.cat([s[2] for s in samples if s[2] is not None])
    mrope = packed_mrope_positions(ids.numpy(), pos.numpy(), grid.numpy(), cfg.image_token_id, 2)
    with torch.no_grad():
        packed = model(ids, pos, pixel_values=pixels, image_grid_thw=grid)
        packed_given = model(
            ids, pos, pixel_values=pixels, image_grid_thw=grid, mrope_position_ids=torch.from_numpy(mrope)
        )
        assert torch.equal(packed, packed_given)
        start = 0
        for s_ids, s_pix, s_grid in samples:
            alone = model(s_ids[None], pixel_values=s_pix, image_grid_thw=s_grid)
            diff = (packed[0, start : start + len(s_ids)] - alone[0]).abs().max().item()
            assert diff < 1e-5, diff
            start += len(s_ids)
        targets = torch.roll(ids, -1, 1)
        lp, _ = model(ids, pos, pixel_values=pixels, image_grid_thw=grid, targets=targets)
        ref = torch.log_softmax(packed, -1).gather(-1, targets[..., None])[..., 0]
        assert (lp - ref).abs().max() < 1e-5


def test_placeholder_mismatch_is_a_clear_error(vl_dir):
    cfg = tiny_qwen3_vl_config()
    ids, pixels, grid = _image_sample([(1, 4, 8)], cfg)
    model = load_model(vl_dir)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model(ids[None, :-6], pixel_values=pixels, image_grid_thw=grid)


def test_frozen_vision_tower_and_backward(vl_dir):
    cfg = tiny_qwen3_vl_config()
    model = load_model(vl_dir)
    ids, pixels, grid = _image_sample([(1, 4, 4)], cfg)
    lp, _ = model(ids[None], pixel_values=pixels, image_grid_thw=grid, targets=torch.roll(ids, -1)[None])
    lp.sum().backward()
    assert model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.visual.deepstack_merger_list[1].linear_fc2.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    # A text-only batch still gives every trainable vision parameter a (zero) gradient (same FSDP reduce on ranks).
    lp, _ = model(ids[None, :2], targets=ids[None, 1:3])
    lp.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.visual.parameters())
    model.zero_grad(set_to_none=True)
    model.freeze_vision()
    lp, _ = model(ids[None], pixel_values=pixels, image_grid_thw=grid, targets=torch.roll(ids, -1)[None])
    lp.sum().backward()
    assert all(p.grad is None for p in model.visual.parameters())
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_random_init_bf16_and_meta():
    cfg = tiny_qwen3_vl_config()
    a, b = load_model(cfg.to_dict(), seed=4), load_model(cfg, seed=4)
    for (k, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(ta, tb), k
    assert a.visual.pos_embed.weight.std() > 0 and a.visual.blocks[0].norm1.weight.eq(1).all()
    bf = load_model(cfg, dtype=torch.bfloat16, seed=4)
    ids, pixels, grid = _image_sample([(1, 4, 4)], cfg)
    assert bf(ids[None], pixel_values=pixels, image_grid_thw=grid).dtype == torch.bfloat16
    assert bf.model.rotary_emb.inv_freq.dtype == torch.float32
    assert load_model(cfg, device="meta").visual.patch_embed.proj.weight.is_meta
