"""A directory inside the server's weight roots that someone else wrote (another user of a shared filesystem): its
files may link outside the roots (to weights the server must not serve) or to a FIFO (whose opening blocks the
loader for ever). ``/update_weights`` and ``/v1/load_lora_adapter`` refuse it in one 4xx line naming the file, before
the engine reads anything, and the server goes on serving what it served."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from .helpers import save_model, start_server


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("roots")
    outside = save_model(tmp_path_factory.mktemp("outside") / "private", tokenizer, seed=2)
    s = start_server(model_dir, server={"weight_roots": [str(root)]})
    s.paths = {"root": root, "outside": outside}
    yield s
    s.stop()


def _post(server, route, body):
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def _served_step(server):
    return httpx.get(f"{server.url}/health", timeout=10).json().get("weight_step")


def _planted(server, name, tokenizer, target):
    """A complete weights directory inside the roots whose ``model.safetensors`` is a link to ``target``."""
    path = save_model(server.paths["root"] / name, tokenizer, seed=3)
    (path / "model.safetensors").unlink()
    os.symlink(target, path / "model.safetensors")
    return path


def test_weights_linked_from_outside_the_roots_are_refused(guarded, tokenizer):
    before = _served_step(guarded)
    path = _planted(guarded, "linked", tokenizer, guarded.paths["outside"] / "model.safetensors")
    r = _post(guarded, "/update_weights", {"weight_dir": str(path), "step": 5})
    assert r.status_code == 403, r.text
    message = r.json()["error"]["message"]
    assert message == f"weight_dir {path}/model.safetensors leads outside the server's weight roots", message
    assert _served_step(guarded) == before


def test_weights_that_are_a_fifo_are_refused_not_opened(guarded, tokenizer, tmp_path):
    fifo = guarded.paths["root"] / "fifo"
    os.mkfifo(fifo)
    path = _planted(guarded, "fifo_dir", tokenizer, fifo)
    r = _post(guarded, "/update_weights", {"weight_dir": str(path), "step": 6})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"weight_dir {path}/model.safetensors is not a regular file"


def test_an_adapter_linked_from_outside_the_roots_is_refused(guarded, tmp_path):
    outside = tmp_path / "adapter"
    outside.mkdir()
    (outside / "adapter_model.safetensors").write_bytes(b"x")
    inside = guarded.paths["root"] / "adapter"
    inside.mkdir()
    (inside / "adapter_config.json").write_text("{}")
    os.symlink(outside / "adapter_model.safetensors", inside / "adapter_model.safetensors")
    r = _post(guarded, "/v1/load_lora_adapter", {"lora_name": "planted", "lora_path": str(inside)})
    assert r.status_code == 403, r.text
    message = r.json()["error"]["message"]
    assert message == f"lora_path {inside}/adapter_model.safetensors leads outside the server's weight roots", message
    shutil.rmtree(inside)
