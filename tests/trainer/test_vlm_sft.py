"""SFT on image conversations: placeholder expansion, masks, image-safe truncation, packing, the micro-batch file, and
a short CPU run on color-shapes data that lowers the validation loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prime_core.config.trainer import LossMaskConfig
from prime_core.monitor import read_metrics
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta, read_microbatches, write_microbatches
from prime_core.vision import VisionSpec, load_image, mrope_positions
from prime_trainer.sft.data import PackedData, build_samples, load_tokenizer, pack

from tests.tiny import write_tiny_vl_model_dir
from tests.trainer.trainer_utils import run_cli


def _corpus():
    import color_shapes

    examples = color_shapes.generate_examples(200, seed=99)
    return [color_shapes.SYSTEM_PROMPT, *(f"{e['question']} {e['completion']}" for e in examples)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path, _ = write_tiny_vl_model_dir(tmp_path_factory.mktemp("tiny-vl"), _corpus())
    return path


@pytest.fixture(scope="module")
def vision(vl_dir):
    return VisionSpec.from_model_dir(vl_dir)


def _rows(n, seed=0):
    import color_shapes

    return color_shapes.sft_rows(n, seed=seed)


def test_images_expand_to_placeholders_never_trained(vl_dir, vision):
    tokenizer = load_tokenizer(str(vl_dir), None)
    rows = _rows(3)
    # The same image as a path, raw bytes and through the row's `images` column gives the same sample.
    image = load_image(rows[0]["messages"][1]["content"][0]["image_url"]["url"])
    png = vl_dir / "scene.png"
    image.save(png)
    question = rows[0]["messages"][1]["content"][1]
    variants = [
        rows[0],
        {"messages": [rows[0]["messages"][0], {"role": "user", "content": [{"type": "image", "image": str(png)},
                                                                          question]}, rows[0]["messages"][2]]},
        {"images": [{"bytes": png.read_bytes()}],
         "messages": [rows[0]["messages"][0], {"role": "user", "content": [{"type": "image"}, question]},
                      rows[0]["messages"][2]]},
    ]  # fmt: skip
    samples = build_samples(variants, tokenizer, LossMaskConfig(), 256, vision)
    s = samples[0]
    assert all(np.array_equal(x.input_ids, s.input_ids) and x.image_grid_thw.tolist() == [[1, 8, 8]] for x in samples)
    placeholders = np.flatnonzero(s.input_ids == vision.image_token_id)
    assert len(placeholders) == 16 and np.all(np.diff(placeholders) == 1)
    assert s.input_ids[placeholders[0] - 1] == vision.vision_start_token_id
    assert s.input_ids[placeholders[-1] + 1] == vision.vision_end_token_id
    assert not s.loss_mask[placeholders].any()
    trained = tokenizer.decode(s.input_ids[s.loss_mask])
    assert trained == rows[0]["messages"][2]["content"] + "<|im_end|>\n"
    assert np.array_equal(s.mrope_position_ids, mrope_positions(s.input_ids, vision.image_token_id, [[1, 8, 8]], 2))


def test_truncation_never_cuts_an_image(vl_dir, vision):
    tokenizer = load_tokenizer(str(vl_dir), None)
    row = _rows(1)[0]
    two_images = {"messages": [row["messages"][0],
                               {"role": "user", "content": [row["messages"][1]["content"][0], *row["messages"][1]["content"]]},
                               row["messages"][2]]}  # fmt: skip
    (full,) = build_samples([two_images], tokenizer, LossMaskConfig(), 512, vision)
    starts = np.flatnonzero(full.input_ids == vision.vision_start_token_id)
    # Cut inside the second image: it is dropped whole with its <|vision_start|>; the first image stays.
    cut = int(starts[1]) + 5
    tokenizer_mask = LossMaskConfig(user=True)  # keeps a trained token before the cut
    (short,) = build_samples([two_images], tokenizer, tokenizer_mask, cut, vision)
    assert len(short.input_ids) == starts[1] and short.image_grid_thw.shape == (1, 3) and len(short.images) == 1
    assert (short.input_ids == vision.image_token_id).sum() == 16
    with pytest.raises(ValueError, match="rendered 0 image placeholders for 1 images"):
        tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
        build_samples([row], tokenizer, LossMaskConfig(), 256, vision)
    # Still refused when the row is longer than seq_len: only a conversation tokenized in part may lack later images.
    with pytest.raises(ValueError, match="rendered 0 image placeholders for 1 images"):
        build_samples([row], tokenizer, LossMaskConfig(), 4, vision)


def test_packed_rows_carry_patches_and_restarting_3d_positions(vl_dir, vision, tmp_path):
    tokenizer = load_tokenizer(str(vl_dir), None)
    text_row = {"messages": [{"role": "user", "content": "How many red shapes?"},
                             {"role": "assistant", "content": "<answer>1</answer>"}]}  # fmt: skip
    samples = build_samples([*_rows(2), text_row], tokenizer, LossMaskConfig(), 256, vision)
    (row,) = pack(samples, np.arange(3), 256, vision=vision)
    assert row.pixel_values.shape == (2 * 64, 3 * 2 * 4 * 4) and row.image_grid_thw.tolist() == [[1, 8, 8]] * 2
    starts = np.flatnonzero(row.position_ids[0] == 0)
    assert np.all(row.mrope_position_ids[:, 0, starts] == 0)
    pixel_0, _ = vision.processor(samples[0].images[0])
    assert np.array_equal(row.pixel_values[:64], pixel_0)
    data = PackedData(samples, 128, 2, 2, shuffle=True, seed=0, vision=vision)
    (mb,) = data.next_batch(0, 1)
    assert mb.shape == (2, 128) and mb.mrope_position_ids.shape == (3, 2, 128)
    assert mb.image_grid_thw.shape[0] == int((mb.input_ids == vision.image_token_id).sum()) // 16
    path = tmp_path / "rank_0.safetensors"
    write_microbatches(path, RolloutBatchMeta(step=0, rank=0, num_micro_batches=2, seq_len=128),
                       [mb, MicroBatch.empty(2, 128)])  # fmt: skip
    _, (back, empty) = read_microbatches(path)
    assert np.array_equal(back.pixel_values, mb.pixel_values) and np.array_equal(back.image_grid_thw, mb.image_grid_thw)
    assert np.array_equal(back.mrope_position_ids, mb.mrope_position_ids) and empty.pixel_values is None


def test_sft_on_color_shapes_lowers_validation_loss(vl_dir, tmp_path):
    data = tmp_path / "color_shapes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(240, seed=1)))
    out = tmp_path / "out"
    run_cli(
        ["--model.name", str(vl_dir), "--init.random", "--data.path", str(data), "--output-dir", str(out),
         "--seq-len", "128", "--max-steps", "30", "--data.batch-size", "4", "--optim.lr", "3e-3",
         "--val.fraction", "0.1", "--val.interval", "30", "--log.level", "warning"],
        module="prime_trainer.entrypoints.sft",
    )  # fmt: skip
    val = [r.values["val/loss"] for r in read_metrics(out / "metrics.jsonl") if r.values.get("val/loss") is not None]
    print(f"color-shapes SFT val loss: {val[0]:.3f} -> {val[-1]:.3f}")
    assert len(val) == 2 and val[-1] < val[0] - 1.0, val
    final = out / "weights" / "step_30"
    assert (final / "preprocessor_config.json").is_file() and (final / "model.safetensors").is_file()
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3_vl"
