"""Fixtures: a tiny random Qwen3 model, a second set of weights, and an in-process server."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import build_tokenizer, save_model, start_server


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    return save_model(tmp_path_factory.mktemp("models") / "base", tokenizer, seed=0)


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory, tokenizer) -> Path:
    return save_model(tmp_path_factory.mktemp("weights") / "step_1", tokenizer, seed=1)


@pytest.fixture(scope="module")
def server(model_dir):
    # As `rl` serves rollouts: log-probs of the distribution each token was drawn from (the trainer's).
    s = start_server(model_dir, logprobs_mode="processed")
    yield s
    s.stop()
