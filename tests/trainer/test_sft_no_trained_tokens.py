"""SFT data with no trained token (a ``data.loss_mask`` that trains no role the data has, every answer past
``seq_len``) was one line only after the model had been built (``common.setup``: minutes for a large model on a GPU
host). It is now found before: the rows are tokenized first, and the line names the data and why."""

from __future__ import annotations

import json
import logging

import pytest
from prime_core.config import ConfigError
from prime_core.config.trainer import SFTConfig

from tests.trainer.trainer_utils import TINY_QWEN3, write_char_tokenizer


def user_only(n: int) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": "ab"}]}) + "\n" for _ in range(n))


@pytest.fixture
def no_model_build(monkeypatch):
    import prime_trainer.sft.train as sft_train

    def setup(*_args, **_kwargs):
        raise AssertionError("the model was built before the data was tokenized")

    monkeypatch.setattr(sft_train.common, "setup", setup)
    return sft_train


def config_for(tmp_path, **extra) -> SFTConfig:
    model = write_char_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps({**TINY_QWEN3, "vocab_size": 100}))
    return SFTConfig.model_validate(
        {"model": {"name": str(model)}, "init": {"random": True}, "seq_len": 64, "output_dir": str(tmp_path), **extra}
    )


def test_data_with_no_trained_token_fails_before_the_model_is_built(tmp_path, no_model_build):
    (tmp_path / "d.jsonl").write_text(user_only(2))
    config = config_for(tmp_path, data={"path": str(tmp_path / "d.jsonl")})
    with pytest.raises(ConfigError) as e:
        no_model_build.train(config)
    assert str(e.value) == (
        f"data.path: none of its 2 rows has a trained token: 2 because they have no message of a trained role "
        f"(data.loss_mask) (first: {tmp_path / 'd.jsonl'} line 1)"
    )


def test_validation_data_with_no_trained_token_fails_before_the_model_is_built(tmp_path, no_model_build):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "ab", "completion": "ba"}) + "\n")
    (tmp_path / "v.jsonl").write_text(user_only(1))
    config = config_for(tmp_path, data={"path": str(tmp_path / "d.jsonl")}, val={"path": str(tmp_path / "v.jsonl")})
    with pytest.raises(ConfigError, match=r"^val\.path: none of its 1 rows has a trained token: "):
        no_model_build.train(config)


def test_the_datas_warnings_wait_for_logging_and_are_logged_once_it_is_set_up(tmp_path, caplog):
    """Tokenized before logging is set up, a skipped row's warning would miss the log file; it is held, then logged."""
    from prime_trainer.sft.train import log_held, tokenize_before_model

    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "ab", "completion": "ba"}) + "\n" + user_only(1))
    config = config_for(tmp_path, data={"path": str(tmp_path / "d.jsonl")})
    caplog.set_level(logging.WARNING)
    samples, held = tokenize_before_model(config)
    assert len(samples[0]) == 1 and samples[1] is None
    assert "skipped 1 of 2 rows" not in caplog.text
    log_held(held)
    assert caplog.text.count("data.path: skipped 1 of 2 rows: 1 because they have no message of a trained role") == 1
