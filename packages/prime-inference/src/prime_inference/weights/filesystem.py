"""Filesystem transport, inference side: the engine loads the directory's HF safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_core.schemas.weights import Manifest

from prime_inference.protocol import RequestError
from prime_inference.weights.base import WeightReceiver

if TYPE_CHECKING:
    from prime_inference.engines.base import Engine


class FilesystemReceiver(WeightReceiver):
    def check(self, path: Path, manifest: Manifest) -> None:
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise RequestError(f"weight_dir {path} holds no config.json and *.safetensors", param="weight_dir")

    async def apply(self, engine: Engine, path: Path, manifest: Manifest, step: int | None) -> dict[str, Any]:
        await engine.update_weights(str(path), step)
        return {"weight_step": engine.info.weight_step, "weight_dir": str(path)}
