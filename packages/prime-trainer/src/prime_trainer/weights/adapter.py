"""LoRA-adapter transport, trainer side: ``weights/step_N`` holds the adapter in PEFT format
(``adapter_config.json``, ``adapter_model.safetensors``) and ``prime_adapter.json`` naming it; inference loads it as
that adapter on the base model it already serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prime_core.run_dir import RunDir
from prime_core.schemas.adapters import AdapterInfo
from prime_models.lora import save_adapter
from torch import nn

from prime_trainer.weights.base import WeightPublisher
from prime_trainer.world import World


class AdapterPublisher(WeightPublisher):
    """Publishes one LoRA adapter (``adapter``, trained on ``base_model``) as ``weights/step_N`` of ``run_dir``."""

    def __init__(
        self, run_dir: RunDir, world: World, async_level: int, keep_all: bool = False, *, adapter: str, base_model: str
    ):
        super().__init__(run_dir, world, async_level, keep_all)
        self.adapter = adapter
        self.base_model = base_model

    @classmethod
    def build(cls, run_dir: RunDir, world: World, config: Any, *, keep_all: bool, tokenizer: str, adapter: str | None):
        assert adapter is not None, "the adapter transport publishes a named adapter"
        return cls(run_dir, world, config.async_level, keep_all, adapter=adapter, base_model=config.model.name)

    def write(self, directory: Path, step: int, model: nn.Module, *, durable: bool, serve: bool) -> None:
        save_adapter(model, self.adapter, directory, base_model=self.base_model, dtype=self.dtype)

    def manifest(self, step: int, *, serve: bool) -> AdapterInfo:
        return AdapterInfo(name=self.adapter, step=step, base_model=self.base_model)
