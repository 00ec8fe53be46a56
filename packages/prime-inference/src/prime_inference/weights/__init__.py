"""Weight transports, inference side: ``POST /update_weights`` makes the engine serve an announced directory.

The directory's manifest (`prime_core.schemas.weights.read_manifest`) names its transport; `RECEIVERS` maps that
name to the transport's `WeightReceiver` (one module per transport here, its trainer side in
``prime_trainer.weights``). Nothing else in the server reads a transport's files.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_core.schemas.weights import ChangedWeights, Manifest, WeightUpdateRequest, read_manifest, verify_weights

from prime_inference.protocol import RequestError
from prime_inference.weights.adapter import AdapterReceiver
from prime_inference.weights.base import StreamReceiver, TransferError, WeightReceiver, announced_dir
from prime_inference.weights.broadcast import BroadcastReceiver
from prime_inference.weights.cuda_ipc import CudaIpcReceiver
from prime_inference.weights.filesystem import FilesystemReceiver

if TYPE_CHECKING:
    from prime_inference.engines.base import Engine

RECEIVERS: dict[str, type[WeightReceiver]] = {
    "filesystem": FilesystemReceiver,
    "broadcast": BroadcastReceiver,
    "adapter": AdapterReceiver,
    "cuda_ipc": CudaIpcReceiver,
}
"""Manifest ``type`` -> its receiver: the one place a transport is chosen on the inference side."""
LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError)
__all__ = [
    "LOAD_ERRORS",
    "RECEIVERS",
    "AdapterReceiver",
    "BroadcastReceiver",
    "CudaIpcReceiver",
    "FilesystemReceiver",
    "StreamReceiver",
    "TransferError",
    "WeightReceiver",
    "check",
    "receiver_for",
    "stream_receiver",
    "update_weights",
    "verify_files",
]


def receiver_for(manifest: Manifest) -> WeightReceiver:
    return RECEIVERS[manifest.type]()


def stream_receiver(manifest: Manifest) -> StreamReceiver:
    """The receiver whose `StreamReceiver.tensors` the engine runs for ``manifest`` (`Engine.receive_weights`)."""
    receiver = receiver_for(manifest)
    if not isinstance(receiver, StreamReceiver):
        raise TypeError(f"{manifest.type} weights are not streamed to the engine")
    return receiver


def check(request: WeightUpdateRequest, roots: list[Path]) -> tuple[Path, Manifest, WeightReceiver]:
    """Everything refused before the engine is touched: the directory, its manifest and the transport's own check."""
    path = announced_dir(request.weight_dir, roots)
    try:
        manifest = read_manifest(path, request.source)
    except ValueError as e:
        raise RequestError(str(e), param="weight_dir") from e
    receiver = receiver_for(manifest)
    receiver.check(path, manifest)
    return path, manifest, receiver


async def verify_files(path: Path, step: int | None, param: str) -> None:
    """The directory's files must be what the trainer wrote (its ``checksums.json``; none: not checked), else a
    `RequestError` naming the file. On a thread: reading gigabytes must not stop the server answering requests."""
    try:
        await asyncio.to_thread(verify_weights, path, step)
    except ChangedWeights as e:
        raise RequestError(str(e), param=param) from None


async def update_weights(engine: Engine, request: WeightUpdateRequest, roots: list[Path]) -> dict[str, Any]:
    """Serve the weights ``request`` announces; a failure is one `RequestError` naming the directory."""
    if request.step is not None and request.step < 0:
        raise RequestError("step must be >= 0", param="step")
    path, manifest, receiver = check(request, roots)
    if manifest.repeatable:  # the engine loads the directory's files
        await verify_files(path, request.step, "weight_dir")
    try:
        return {"status": "ok", **await receiver.apply(engine, path, manifest, request.step)}
    except RequestError:
        raise
    except TransferError as e:
        raise RequestError(f"{manifest.type} weights of {request.weight_dir} failed: {e}", status_code=504) from e
    except LOAD_ERRORS as e:
        raise RequestError(f"failed to load weights from {request.weight_dir}: {e}", param="weight_dir") from e
