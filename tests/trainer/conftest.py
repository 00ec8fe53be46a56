import json
from pathlib import Path

import pytest

from tests.trainer.trainer_utils import TINY_QWEN3


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A config-only Qwen3 directory: the trainer initializes it randomly (seeded)."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    (path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return path
