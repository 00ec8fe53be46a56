"""CUDA IPC transport, inference side: the trainer's tensors are opened in place from CUDA IPC handles on the GPU
that trainer and inference share (see ``prime_trainer.weights.cuda_ipc`` and `prime_core.schemas.weights`).

`CudaIpcReceiver.tensors` runs inside every vLLM worker (through the worker extension) and in the torch engine's
process. Per bucket it reads the `CudaIpcBucket` from the trainer's store, opens its buffer with torch's
``rebuild_cuda_tensor`` (no pickle: the handle is plain data), yields views into it, and acknowledges once the
engine asks for the next bucket (so the engine must have copied what it keeps). Everything from the store is
checked against the buffer before a view is made. torch is imported lazily so the server imports without it.

A manifest with an ``adapter`` hands over a LoRA adapter's PEFT-keyed tensors: the engine serves them under the
adapter's name (`Engine.receive_adapter`) instead of loading them into its base model.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_core.schemas.weights import CudaIpcBucket, CudaIpcHandle, CudaIpcManifest

from prime_inference.weights.base import Bucket, StreamReceiver, TransferError

if TYPE_CHECKING:
    import torch

    from prime_inference.engines.base import Engine


class CudaIpcError(TransferError):
    """The trainer did not hand a bucket over in time, failed, or handed over something that cannot be opened here."""


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU (stable across processes, unlike an index under CUDA_VISIBLE_DEVICES)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else device.type


def open_handle(handle: CudaIpcHandle, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """The trainer's flat buffer, mapped on ``device`` (torch's receiving half of ``reduce_tensor``)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    # The torch engine's device is plain "cuda" (index None); the handle must be opened on a concrete device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(
        torch.Tensor, (numel,), (1,), 0, torch.storage.TypedStorage, dtype, index,
        _bytes(handle.storage_handle), handle.storage_size_bytes, handle.storage_offset_bytes, False,
        _bytes(handle.ref_counter_handle), handle.ref_counter_offset, _bytes(handle.event_handle),
        handle.event_sync_required,
    )  # fmt: skip


def views(bucket: CudaIpcBucket, device: torch.device) -> Bucket:
    """The bucket's tensors as views into its opened buffer, after checking every size and offset against it."""
    import torch

    dtype = getattr(torch, bucket.dtype, None)
    if not isinstance(dtype, torch.dtype) or bucket.handle is None:
        raise CudaIpcError(f"cuda_ipc bucket {bucket.index} names no torch dtype or handle: {bucket.dtype!r}")
    if bucket.numel * dtype.itemsize > bucket.handle.storage_size_bytes:
        raise CudaIpcError(f"cuda_ipc bucket {bucket.index}: {bucket.numel} x {bucket.dtype} exceeds its allocation")
    out = []
    for name, shape, offset in bucket.tensors:
        numel = 1
        for dim in shape:
            numel *= dim
        if offset < 0 or min(shape, default=1) < 0 or offset + numel > bucket.numel:
            raise CudaIpcError(f"cuda_ipc bucket {bucket.index}: {name} {shape} at {offset} is outside its buffer")
        out.append((name, shape, offset, numel))
    flat = open_handle(bucket.handle, dtype, bucket.numel, device)
    return [(name, flat[offset : offset + numel].view(shape)) for name, shape, offset, numel in out]


class _Client:
    """This process's connection to one trainer store (kept across steps; dropped after a failure)."""

    def __init__(self, manifest: CudaIpcManifest):
        import torch.distributed as dist

        m = manifest
        try:
            master = dist.TCPStore(m.host, m.port, None, False, timeout=timedelta(seconds=m.timeout_s))
        except Exception as e:
            raise CudaIpcError(
                f"could not reach the trainer's store at {m.host}:{m.port} within {m.timeout_s:g}s: {e}"
            ) from e
        self.store = dist.PrefixStore("prime-ipc", master)
        self.timeout_s = m.timeout_s

    def next_bucket(self, step: int, index: int) -> CudaIpcBucket:
        key = f"{step}/bucket/{index}"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
            return CudaIpcBucket.model_validate_json(self.store.get(key))
        except ValueError as e:
            raise CudaIpcError(f"cuda_ipc bucket {index} of step {step} is malformed: {e}") from e
        except RuntimeError as e:
            raise CudaIpcError(
                f"the trainer handed over no bucket {index} of step {step} in {self.timeout_s:g}s: {e}"
            ) from e


_clients: dict[tuple[str, int], _Client] = {}
_lock = threading.Lock()


def _client(manifest: CudaIpcManifest) -> _Client:
    key = (manifest.host, manifest.port)
    with _lock:
        if key not in _clients or _clients[key].timeout_s != manifest.timeout_s:
            _clients[key] = _Client(manifest)
        return _clients[key]


class CudaIpcReceiver(StreamReceiver):
    async def apply(self, engine: Engine, path: Path, manifest: CudaIpcManifest, step: int | None) -> dict[str, Any]:
        if manifest.adapter is None:
            return await super().apply(engine, path, manifest, step)
        step = manifest.step if step is None else step
        await engine.receive_adapter(manifest.adapter.name, manifest, step)
        return {"lora_name": manifest.adapter.name, "weight_step": step, "weight_dir": str(path)}

    def tensors(self, manifest: CudaIpcManifest, device: torch.device) -> Iterator[Bucket]:
        if (here := gpu_uuid(device)) != manifest.gpu_uuid:
            raise CudaIpcError(f"cuda_ipc hands over GPU memory of {manifest.gpu_uuid}; this worker runs on {here}: "
                               "trainer and inference must share the GPU (else weights.broadcast.type = 'nccl')")  # fmt: skip
        client = _client(manifest)
        step, store = manifest.step, client.store
        worker = int(store.add(f"{step}/workers", 1)) - 1
        try:
            if worker >= manifest.num_workers:
                raise CudaIpcError(f"cuda_ipc step {step} expects {manifest.num_workers} worker(s), this is one more: "
                                   "set weights.broadcast.inference_workers to the real count")  # fmt: skip
            index = 0
            while (bucket := client.next_bucket(step, index)).handle is not None:
                yield views(bucket, device)
                store.set(f"{step}/taken/{index}/{worker}", b"1")  # the engine asked for more: it copied this one
                index += 1
            if bucket.error is not None:
                raise CudaIpcError(f"the trainer failed handing over step {step}: {bucket.error}")
            store.set(f"{step}/taken/{index}/{worker}", b"1")  # the end, read: the trainer may forget the step
        except (CudaIpcError, GeneratorExit) as e:
            _fail(manifest, store, e)
            raise
        except Exception as e:  # the store or CUDA refused: a failed transfer, not a bad directory
            _fail(manifest, store, e)
            raise CudaIpcError(f"cuda_ipc step {step}: {type(e).__name__}: {e}") from e


def _fail(manifest: CudaIpcManifest, store: Any, error: BaseException) -> None:
    """Tell the waiting trainer at once (instead of after its timeout); a broken connection is not reused."""
    message = "the engine stopped taking buckets" if isinstance(error, GeneratorExit) else str(error)
    with contextlib.suppress(Exception):
        store.set(f"{manifest.step}/failed", message[:2000].encode())
    with _lock:
        _clients.pop((manifest.host, manifest.port), None)
