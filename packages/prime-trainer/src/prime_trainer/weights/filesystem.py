"""Filesystem transport, trainer side: ``weights/step_N`` holds HF safetensors + config + tokenizer files, which
inference loads from the shared filesystem."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from prime_core.run_dir import RunDir
from prime_models import save_hf
from torch import nn

from prime_trainer.weights.base import WeightPublisher
from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")

_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|chat_template\..*"
    r"|(video_)?preprocessor_config\.json|processor_config\.json)$"
)


def copy_tokenizer_files(src: str, dst: Path) -> None:
    """Copy tokenizer files of ``src`` (a directory, or a hub id resolved through transformers) into ``dst``."""
    src_path = Path(src).expanduser()
    if src_path.is_dir():
        for f in src_path.iterdir():
            if f.is_file() and _TOKENIZER_FILES.match(f.name):
                shutil.copy2(f, dst / f.name)
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(src).save_pretrained(str(dst))
    except Exception as e:  # a missing tokenizer must not stop training; inference then needs --tokenizer
        logger.warning("could not copy tokenizer %s into %s: %s", src, dst, e)


class FilesystemPublisher(WeightPublisher):
    def __init__(self, run_dir: RunDir, world: World, async_level: int, keep_all: bool = False, *, tokenizer: str):
        super().__init__(run_dir, world, async_level, keep_all)
        self.tokenizer = tokenizer

    @classmethod
    def build(cls, run_dir: RunDir, world: World, config: Any, *, keep_all: bool, tokenizer: str, adapter: str | None):
        return cls(run_dir, world, config.async_level, keep_all, tokenizer=tokenizer)

    def write_hf(self, directory: Path, model: nn.Module) -> None:
        """The HF directory: sharded safetensors and config (collective), and the tokenizer's files (rank 0)."""
        self.written.update(save_hf(model, directory, dtype=self.dtype))
        if self.world.is_master:
            copy_tokenizer_files(self.tokenizer, directory)

    def write(self, directory: Path, step: int, model: nn.Module, *, durable: bool, serve: bool) -> None:
        self.write_hf(directory, model)
