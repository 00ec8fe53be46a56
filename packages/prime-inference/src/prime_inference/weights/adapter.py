"""LoRA-adapter transport, inference side: the directory's PEFT adapter replaces the served adapter its
``prime_adapter.json`` names (how the orchestrator relays each step of a LoRA run)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterInfo, is_adapter_dir

from prime_inference.protocol import RequestError
from prime_inference.weights.base import WeightReceiver

if TYPE_CHECKING:
    from prime_inference.engines.base import Engine


class AdapterReceiver(WeightReceiver):
    def check(self, path: Path, manifest: AdapterInfo) -> None:
        if not is_adapter_dir(path):
            raise RequestError(f"weight_dir {path} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}", param="weight_dir")

    async def apply(self, engine: Engine, path: Path, manifest: AdapterInfo, step: int | None) -> dict[str, Any]:
        step = manifest.step if step is None else step
        await engine.load_adapter(manifest.name, str(path), step)
        return {"lora_name": manifest.name, "weight_step": step, "weight_dir": str(path)}
