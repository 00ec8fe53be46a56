"""Broadcast transport, inference side: the tensors of one update arrive from the trainer's rank 0 over a collective
group (NCCL between GPUs, gloo on CPU; wire protocol in `prime_core.schemas.weights`).

`BroadcastReceiver.tensors` runs inside every vLLM worker (through the worker extension) and in the torch engine's
process. A process joins the group of a given store address once and keeps it for later updates. torch is imported
lazily so the server imports without it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

from prime_core.schemas.weights import BroadcastManifest, BucketHeader

from prime_inference.weights.base import Bucket, StreamReceiver, TransferError

if TYPE_CHECKING:
    import torch


class BroadcastError(TransferError):
    """The trainer did not show up, or a transfer failed or timed out."""


class _Member:
    def __init__(self, manifest: BroadcastManifest, device: torch.device):
        import torch.distributed as dist

        m = manifest
        timeout = timedelta(seconds=m.timeout_s)
        try:
            self.store = dist.TCPStore(m.host, m.port, m.world_size, False, timeout=timeout)
            self.rank = int(self.store.add("prime-weights/rank", 1))
        except Exception as e:
            raise BroadcastError(
                f"could not join the trainer's weight broadcast at {m.host}:{m.port} within {m.timeout_s:g}s: {e}"
            ) from e
        if self.rank >= m.world_size:
            raise BroadcastError(
                f"weight broadcast at {m.host}:{m.port} expects {m.world_size - 1} inference worker(s), this is "
                f"worker {self.rank}: set the trainer's weights.broadcast.inference_workers to the real count"
            )
        store = dist.PrefixStore("prime-weights", self.store)
        if m.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, self.rank, m.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, m.world_size, timeout)
        self.manifest = m
        self.device = device

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.group.broadcast([tensor], opts).wait(timedelta(seconds=self.manifest.timeout_s))
        except Exception as e:
            raise BroadcastError(
                f"weight broadcast from {self.manifest.host}:{self.manifest.port} failed or timed out after "
                f"{self.manifest.timeout_s:g}s: {e}"
            ) from e
        return tensor

    def buckets(self) -> Iterator[Bucket]:
        """Receive bucket after bucket until the trainer sends the end marker; views into each bucket's buffer."""
        import torch

        while True:
            length = int(self._recv(torch.zeros(1, dtype=torch.int64, device=self.device)).item())
            if length == 0:
                return
            raw = self._recv(torch.empty(length, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes()
            header = BucketHeader.model_validate(json.loads(raw))
            dtype = getattr(torch, header.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise BroadcastError(f"weight broadcast bucket names no torch dtype: {header.dtype!r}")
            flat = self._recv(torch.empty(header.numel, dtype=dtype, device=self.device))
            yield [(name, flat[offset : offset + _numel(shape)].view(shape)) for name, shape, offset in header.tensors]


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_members: dict[tuple[str, int], _Member] = {}
_lock = threading.Lock()


class BroadcastReceiver(StreamReceiver):
    def tensors(self, manifest: BroadcastManifest, device: torch.device) -> Iterator[Bucket]:
        """Join the broadcast group of ``manifest`` (first time only) and yield the received buckets of one update."""
        key = (manifest.host, manifest.port)
        with _lock:
            member = _members.get(key)
            if member is None or member.manifest.world_size != manifest.world_size:
                member = _members[key] = _Member(manifest, device)
        member.manifest = manifest
        try:
            yield from member.buckets()
        except BroadcastError:
            # A broken group cannot be reused: the next update joins afresh.
            _members.pop(key, None)
            raise
