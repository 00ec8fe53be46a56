"""A model directory the trainer is pointed at that someone else wrote (a download, a shared path): its config asks
for more memory than the device has, or its shards name files outside it. One line naming the file, never the
allocator's traceback or a model trained from weights that came from elsewhere."""

import json
import subprocess
import sys

import torch
from safetensors.torch import save_file

from tests.trainer.trainer_utils import TINY_QWEN3


def _trainer(model_dir, out):
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer", "--bench", "--model.name", str(model_dir),
           "--output-dir", str(out), "--max-steps", "1", "--seq-len", "32", "--log.level", "warning"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_a_config_too_large_for_the_device_is_one_line_exit_2(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY_QWEN3, "vocab_size": 10**12}))
    proc = _trainer(model, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model.name {model}: model config: the weights need "), last
    assert "GiB of cpu memory (vocab_size=1000000000000, hidden_size=32," in last, last


def test_an_index_naming_a_file_outside_the_model_is_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    save_file({"x": torch.zeros(1)}, str(model / "model-00001-of-00001.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "../../secret/model.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = _trainer(model, tmp_path / "out")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"error: {model}/model.safetensors.index.json: weight_map names "
                    f"'../../secret/model.safetensors', not a file in {model}"), last  # fmt: skip
