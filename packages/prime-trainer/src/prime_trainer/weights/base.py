"""The trainer side of a weight transport: `WeightPublisher`.

Publishing step N is the same for every transport: ``weights/step_N`` is built under a temporary name (every rank
may write into it: FSDP shards are gathered collectively), the transport's manifest goes in (`write_manifest`), the
directory gets ``checksums.json`` (the CRC-32 of every file in it, `write_checksums`; the
safetensors summed from the tensors in memory as they are written, ``written``), is renamed into place and gets its
STABLE marker, old steps nobody can need are deleted, and only then is
the transport asked to deliver (a broadcast waits for inference, which learns of the step from STABLE). A transport
implements `write` (files into the directory), `manifest` and `deliver`.

Old steps are deleted once no reader can need them: the orchestrator samples step s with weights >= s - async_level,
and a resume from checkpoint N needs weights N - async_level .. N.
"""

from __future__ import annotations

import abc
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, final

import torch
from prime_core.io import atomic_dir, atomic_write_json, remove_published, writing
from prime_core.run_dir import WEIGHTS_RUN_FILE, RunDir
from prime_core.schemas.weights import BucketHeader, Manifest, write_checksums, write_manifest
from torch import nn

from prime_trainer.world import World, broadcast_object


class WeightPublisher(abc.ABC):
    """Makes ``weights/step_N`` of ``run_dir`` announce step N's weights, and delivers them to inference."""

    def __init__(self, run_dir: RunDir, world: World, async_level: int, keep_all: bool = False):
        self.run_dir = run_dir
        self.world = world
        self.async_level = async_level
        self.keep_all = keep_all
        # Ship bf16 from GPU runs (what inference serves); keep exact fp32 from CPU runs.
        self.dtype = torch.bfloat16 if world.device.type == "cuda" else None
        self.written: dict[str, str] = {}
        """CRC-32 of files `write` summed as it wrote them (by name); the other files are read back for theirs."""

    @classmethod
    def build(cls, run_dir: RunDir, world: World, config: Any, *, keep_all: bool, tokenizer: str, adapter: str | None):
        """The publisher for a trainer or SFT ``config`` (`prime_trainer.weights.build_publisher` calls this)."""
        return cls(run_dir, world, config.async_level, keep_all)

    @abc.abstractmethod
    def write(self, directory: Path, step: int, model: nn.Module, *, durable: bool, serve: bool) -> None:
        """Write the transport's files into ``directory``; called on every rank (gathering shards is collective)."""

    def manifest(self, step: int, *, serve: bool) -> Manifest | None:
        """The manifest announcing step ``step`` (rank 0); None when the directory's files are the announcement."""
        return None

    def deliver(self, step: int, model: nn.Module) -> dict[str, float]:
        """After STABLE, hand the weights over (collective); returns timings in seconds (``*_s``) and counts."""
        return {}

    @final
    def publish(
        self, step: int, model: nn.Module, keep_steps: list[int] = (), *, durable: bool = True, serve: bool = True
    ) -> dict[str, float]:
        """Announce and deliver step ``step``'s weights; collective over the trainer's ranks. Returns timings.

        ``durable``: the step must stay loadable from its directory alone (initial weights, checkpoint steps, the
        final step); ``serve``: inference will load this step now (False for weights only meant for disk).
        ``keep_steps``: weight steps the retention must not delete (checkpoints').
        """
        final_dir = self.run_dir.weight_step(step)
        t0 = time.perf_counter()
        if self.world.is_master:
            with writing(f"weights step {step}", final_dir), atomic_dir(final_dir) as tmp:
                broadcast_object(str(tmp))
                self.written = {}
                self.write(tmp, step, model, durable=durable, serve=serve)
                manifest = self.manifest(step, serve=serve)
                if manifest is not None:
                    write_manifest(tmp, manifest)
                # Whose weights these are: an orchestrator of another launch does not serve them as its policy.
                atomic_write_json(tmp / WEIGHTS_RUN_FILE, {"run_id": os.environ.get("PRIME_RUN_ID")})
                write_checksums(tmp, self.written)  # last: every reader checks the files against it
            self._cleanup(step, list(keep_steps))
        else:
            with writing(f"weights step {step}", final_dir):
                self.write(Path(broadcast_object(None)), step, model, durable=durable, serve=serve)
        broadcast_object(None)  # nobody moves on before STABLE is written
        timings = {"files_s": time.perf_counter() - t0}
        if serve:
            timings.update(self.deliver(step, model))
        return timings

    def needed(self, latest: int, keep_steps: list[int]) -> set[int]:
        keep = set(range(max(latest - self.async_level, 0), latest + 1))
        for n in keep_steps:
            keep.update(range(max(n - self.async_level, 0), n + 1))
        return keep

    def _cleanup(self, latest: int, keep_steps: list[int]) -> None:
        if self.keep_all or not self.run_dir.weights.is_dir():
            return
        keep = self.needed(latest, keep_steps)
        for child in self.run_dir.weights.iterdir():
            m = re.fullmatch(r"step_(\d+)", child.name)
            if m and int(m.group(1)) not in keep and int(m.group(1)) < latest:
                remove_published(child)


# Helpers of transports that stream tensors (broadcast, cuda_ipc): buckets of HF tensors packed into flat buffers.


def buckets(tensors: Iterator[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive same-dtype tensors into lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > max_bytes or t.dtype != current[0][1].dtype):
            yield current
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        yield current


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[BucketHeader, torch.Tensor]:
    """One flat buffer holding the bucket's tensors back to back, and the header that tells where each one is."""
    dtype = bucket[0][1].dtype
    numel = sum(t.numel() for _, t in bucket)
    flat = torch.empty(numel, dtype=dtype, device=bucket[0][1].device)
    entries, offset = [], 0
    for name, t in bucket:
        flat[offset : offset + t.numel()].copy_(t.reshape(-1))
        entries.append((name, list(t.shape), offset))
        offset += t.numel()
    return BucketHeader(dtype=str(dtype).removeprefix("torch."), numel=numel, tensors=entries), flat
