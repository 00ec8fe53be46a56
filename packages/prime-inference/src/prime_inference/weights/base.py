"""The inference side of a weight transport: `WeightReceiver`, and the checks every announced directory passes.

A receiver makes the engine serve what a ``weights/step_N`` directory announces (`prime_core.schemas.weights`). It
drives the engine through four primitives, so that a transport needs no engine code of its own:

* ``Engine.update_weights(dir)``: the engine loads HF safetensors from a directory;
* ``Engine.receive_weights(manifest)``: where the model lives (every vLLM worker, the torch engine's process) the
  engine iterates `StreamReceiver.tensors` of the manifest's transport and loads each bucket of (HF name, tensor);
* ``Engine.load_adapter(name, dir)``: the engine serves a PEFT LoRA adapter under a name;
* ``Engine.receive_adapter(name, manifest)``: the same from a streamed transport's tensors (an adapter over CUDA IPC).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_core.io import is_stable
from prime_core.schemas.weights import Manifest

from prime_inference.protocol import RequestError

if TYPE_CHECKING:
    import torch

    from prime_inference.engines.base import Engine

Bucket = list[tuple[str, "torch.Tensor"]]
"""(HF parameter name, tensor) pairs received together; the tensors may be views into one buffer."""


class TransferError(RuntimeError):
    """A one-time transfer failed: the sender did not show up, or the transfer stalled or broke (answered 504)."""


class WeightReceiver(abc.ABC):
    """Inference side of one weight transport."""

    def check(self, path: Path, manifest: Manifest) -> None:  # noqa: B027
        """Refuse, before the engine is touched, a directory that cannot hold these weights (`RequestError`)."""

    @abc.abstractmethod
    async def apply(self, engine: Engine, path: Path, manifest: Manifest, step: int | None) -> dict[str, Any]:
        """Make ``engine`` serve the announced weights; returns the response's fields besides ``status``."""


class StreamReceiver(WeightReceiver):
    """A transport whose tensors arrive where the model lives: `tensors` runs inside every vLLM worker (through the
    worker extension) or in the torch engine's process, and the engine loads what it yields."""

    async def apply(self, engine: Engine, path: Path, manifest: Manifest, step: int | None) -> dict[str, Any]:
        await engine.receive_weights(manifest, step)
        return {"weight_step": engine.info.weight_step, "weight_dir": str(path)}

    @abc.abstractmethod
    def tensors(self, manifest: Manifest, device: torch.device) -> Iterator[Bucket]:
        """Receive one update on ``device``: bucket after bucket until the sender is done. A bucket's tensors may
        be reused once the next bucket is asked for, so the caller copies what it keeps (``model.load_weights``
        does). Raise `TransferError` when the sender does not show up or the transfer fails, within the manifest's
        own time limit."""


def confined_dir(path_str: str, roots: list[Path], param: str) -> Path:
    """Resolve ``path_str`` (symlinks included); refuse relative paths and anything outside ``roots``."""
    if not path_str or "\x00" in path_str:
        raise RequestError(f"{param} must be a non-empty path", param=param)
    path = Path(path_str).expanduser()
    if not path.is_absolute():
        raise RequestError(f"{param} must be an absolute path", param=param)
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        raise RequestError(f"{param} cannot be resolved: {e}", param=param) from e
    if roots:
        allowed = [Path(r).expanduser().resolve() for r in roots]
        if not any(resolved == r or resolved.is_relative_to(r) for r in allowed):
            raise RequestError(f"{param} is outside the server's weight roots", status_code=403, param=param)
    return resolved


def confined_files(path: Path, roots: list[Path], param: str) -> None:
    """Every file the engine may read in directory ``path`` (its entries, one level down too) must be a regular file
    inside the weight roots. The directory itself being inside them is not enough: anyone who can write there (a
    shared cluster filesystem) could link ``model.safetensors`` to another user's weights outside the roots, and the
    server would load and serve them; or to a FIFO, whose opening blocks the loader for ever."""
    allowed = [Path(r).expanduser().resolve() for r in roots]
    entries = [
        e for d in (path, *(c for c in path.iterdir() if c.is_dir() and not c.is_symlink())) for e in d.iterdir()
    ]
    for entry in entries:
        target = entry.resolve()
        if allowed and not any(target.is_relative_to(r) for r in allowed):
            raise RequestError(f"{param} {entry} leads outside the server's weight roots", status_code=403, param=param)
        if entry.exists() and not (target.is_file() or target.is_dir()):
            raise RequestError(f"{param} {entry} is not a regular file", param=param)


def announced_dir(weight_dir: str, roots: list[Path]) -> Path:
    """``weight_dir`` resolved inside the weight roots, a directory with the trainer's STABLE marker."""
    path = confined_dir(weight_dir, roots, "weight_dir")
    if not path.is_dir():
        raise RequestError(f"weight_dir {weight_dir} is not a directory", param="weight_dir")
    confined_files(path, roots, "weight_dir")
    if not is_stable(path):
        raise RequestError(
            f"weight_dir {weight_dir} has no STABLE marker (incomplete or not written by the trainer)",
            status_code=409,
            param="weight_dir",
        )
    return path
