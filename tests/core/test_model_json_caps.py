"""A model directory is someone else's (downloaded, shared, published by another process): its small JSON files
(config.json, tokenizer_config.json, preprocessor_config.json, adapter_config.json) are read with a bound. Before,
each reader read the file whole into memory: a config.json of 10 GiB took 10 GiB (and its parse more) in the launcher,
the orchestrator and every trainer rank. Now the file is one line naming it, and what it is not read whole.

The files here are sparse and one byte over the bound: their old readers read them whole (17 MiB of NULs) and failed
on the JSON with another message, or took them."""

import json
import re

import pytest
from prime_core.io import SMALL_JSON_BYTES, UnreadableFile

CONFIG = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 16, "num_hidden_layers": 1}


def _oversized(path):
    with open(path, "wb") as f:
        f.truncate(SMALL_JSON_BYTES + 1)  # sparse: costs nothing to make
    return f"{path}: over {SMALL_JSON_BYTES} bytes, too large for "


def test_the_preflight_names_an_oversized_config_json(tmp_path):
    from prime_core.preflight import check_model_name

    line = _oversized(tmp_path / "config.json")
    assert check_model_name(str(tmp_path), network=False) == line + "a model config"


@pytest.mark.parametrize("reader", ["resolve_config", "vision", "trainer"])
def test_an_oversized_config_json_is_one_line(tmp_path, reader):
    line = _oversized(tmp_path / "config.json") + "a model config"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        if reader == "resolve_config":
            from prime_models.loading import resolve_config

            resolve_config(tmp_path)
        elif reader == "vision":
            from prime_core.vision import VisionSpec

            VisionSpec.from_model_dir(tmp_path)
        else:
            from prime_core.config.trainer import ModelInitConfig
            from prime_trainer.model import resolve_source

            resolve_source(str(tmp_path), ModelInitConfig())


def test_an_oversized_tokenizer_config_is_one_line(tmp_path):
    from prime_orchestrator.rendering import detect_renderer

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    line = _oversized(tmp_path / "tokenizer_config.json") + "a tokenizer config"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        detect_renderer(str(tmp_path))


def test_an_oversized_preprocessor_config_is_one_line(tmp_path):
    from prime_core.vision import ImageProcessor

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "vision_config": {"patch_size": 14}}))
    line = _oversized(tmp_path / "preprocessor_config.json") + "a preprocessor config"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        ImageProcessor.from_model_dir(tmp_path)


def test_an_oversized_adapter_config_is_one_line(tmp_path):
    from prime_models.lora.files import read_adapter

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    line = _oversized(tmp_path / "adapter_config.json") + "an adapter config"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        read_adapter(tmp_path)


def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path):
    from prime_models.loading import resolve_config

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: not a model config"):
        resolve_config(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize("kind", ["oversized", "fifo"])
def test_the_preflight_names_a_file_transformers_would_read_whole(tmp_path, name, kind):
    """transformers and vLLM read these whole, without a bound, in every process (a FIFO blocked each in ``open``).
    Before, the preflight passed the directory and each process hung or took the file's size in memory."""
    import os

    from prime_core.preflight import check_model_name

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    what = {"tokenizer_config.json": "a tokenizer config", "generation_config.json": "a generation config"}[name]
    if kind == "fifo":
        os.mkfifo(tmp_path / name)
        line = f"{str(tmp_path / name)!r} is not a regular file: not {what}"
    else:
        line = _oversized(tmp_path / name) + what
    assert check_model_name(str(tmp_path), network=False) == line
