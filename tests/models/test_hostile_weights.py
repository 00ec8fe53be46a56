"""An HF directory someone else wrote (a downloaded model, a directory a client names to the inference server): its
index may name files outside it, a shard may be a FIFO, a shard may carry a second copy of another shard's tensor.
Each is one ``ValueError`` naming the file, before any weight is loaded from where it should not come."""

import json
import os

import pytest
import torch
from prime_models import load_model, save_hf
from prime_models.loading import INDEX_FILE, checkpoint_files
from safetensors.torch import load_file, save_file

from tests.models.conftest import save_tiny_hf, tiny_config


@pytest.fixture
def sharded(tmp_path):
    """A tiny qwen3 saved in several shards with an index, and (beside it) another model's weights."""
    save_tiny_hf("qwen3", tmp_path / "src")
    save_hf(load_model(tmp_path / "src"), tmp_path / "model", max_shard_size="20KB")
    (tmp_path / "other").mkdir()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other" / "model.safetensors"))
    return tmp_path / "model"


def test_an_index_naming_a_file_outside_the_directory_is_refused(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../other/model.safetensors"
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map names '\.\./other/model\.safetensors', not a file in "):
        checkpoint_files(sharded)
    index["weight_map"][name] = str(sharded.parent / "other" / "model.safetensors")  # absolute
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"weight_map names '/.*/other/model\.safetensors', not a file in "):
        load_model(sharded)


def test_a_shard_that_is_a_fifo_is_refused_not_opened(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the loader would hang for ever."""
    (tmp_path / "config.json").write_text("{}")
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/model\.safetensors: not a regular file$"):
        checkpoint_files(tmp_path)


def test_a_tensor_in_two_shards_is_refused_not_silently_replaced(sharded):
    files = checkpoint_files(sharded)
    first = load_file(files[0])
    name = next(iter(first))
    last = load_file(files[-1])
    last[name] = torch.full_like(first[name], 7.0)  # loaded last, it would win
    save_file(last, str(files[-1]), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^{files[-1]}: holds {name}, which {files[0].name} holds too$"):
        load_model(sharded)


def test_a_config_too_large_for_the_device_is_refused_before_anything_is_allocated(tmp_path):
    """``vocab_size: 10**12`` in a downloaded config.json: a 128 TB embedding the allocator was asked for (a traceback
    from it, or on a host that overcommits, pages touched until the OOM killer came)."""
    config = tiny_config("qwen3", vocab_size=10**12).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config\.json: the weights need [0-9,.]+ GiB, more than the "):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=r"\(vocab_size=1000000000000, hidden_size=32, intermediate_size=64, "):
        load_model(config)


def test_an_adapter_holding_nan_is_refused_and_the_model_keeps_serving_without_it(tmp_path):
    from prime_models import lora as L

    model = load_model(tiny_config("qwen3").to_dict(), seed=0)
    L.apply_lora(model, L.LoRASpec(rank=4, alpha=8.0), adapters=["a"])
    L.save_adapter(model, "a", tmp_path / "adapter", base_model="tiny")
    tensors = load_file(tmp_path / "adapter" / L.ADAPTER_WEIGHTS)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "adapter" / L.ADAPTER_WEIGHTS))
    served = load_model(tiny_config("qwen3").to_dict(), seed=0)
    line = f"adapter {tmp_path}/adapter: model.layers.1.mlp.down_proj lora_B holds NaN or infinite values"
    with pytest.raises(ValueError, match=rf"^{line}$"):
        L.load_adapter(served, "downloaded", tmp_path / "adapter")
    assert "downloaded" not in L.selection(served).specs and not L.lora_layers(served)
