"""Broadcast transport, trainer side: the tensors go to inference over a collective group (NCCL between GPUs, gloo
on CPU) instead of files; ``weights/step_N`` holds only ``broadcast.json`` (plus HF files when the step must stay
loadable from disk: initial weights, checkpoint steps, the final step).

Trainer rank 0 is rank 0 of a small group that only it and the inference workers join; the trainer's own FSDP
group is untouched. The group is opened at the first broadcast (inference joins when the orchestrator relays that
step) and kept for the rest of the run. The wire protocol is described in `prime_core.schemas.weights`.

All trainer ranks call `WeightBroadcaster.send`: FSDP parameters are gathered collectively; only rank 0 sends.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prime_core.config.trainer import WeightBroadcastConfig
from prime_core.run_dir import RunDir
from prime_core.schemas.weights import BroadcastManifest, BucketHeader
from prime_models.checkpoint import hf_state_dict
from torch import nn

from prime_trainer.weights.base import buckets, pack
from prime_trainer.weights.filesystem import FilesystemPublisher
from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")


class BroadcastTimeout(RuntimeError):
    """Inference workers did not join, or a transfer did not complete, within ``weights.broadcast.timeout_s``."""


def _bucket_bytes(config: WeightBroadcastConfig) -> int:
    return config.bucket_mb * 2**20


class WeightBroadcaster:
    def __init__(self, config: WeightBroadcastConfig, world: World):
        self.config = config
        self.world = world
        self.device = world.device
        self.backend = "nccl" if world.device.type == "cuda" else "gloo"
        self._group = None
        self._store = None

    def manifest(self, step: int) -> BroadcastManifest:
        c = self.config
        return BroadcastManifest(
            step=step,
            host=c.host,
            port=c.port,
            world_size=c.inference_workers + 1,
            backend=self.backend,
            timeout_s=c.timeout_s,
        )

    def _join(self) -> None:
        """Open the rendezvous store and wait (up to the timeout) for every inference worker to connect."""
        c = self.config
        timeout = timedelta(seconds=c.timeout_s)
        world_size = c.inference_workers + 1
        try:
            self._store = dist.TCPStore(c.host, c.port, world_size, True, timeout=timeout, wait_for_workers=True)
        except Exception as e:  # DistStoreError on timeout; OSError when the port is taken
            raise BroadcastTimeout(
                f"weight broadcast: {c.inference_workers} inference worker(s) did not all join the store at "
                f"{c.host}:{c.port} within weights.broadcast.timeout_s={c.timeout_s:g}s ({e}); are the orchestrator "
                "and inference running, and is weights.broadcast.inference_workers right?"
            ) from e
        store = dist.PrefixStore("prime-weights", self._store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, 0, world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, 0, world_size, timeout)
        logger.info("weight broadcast group ready: %d inference worker(s) via %s", c.inference_workers, self.backend)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self._group.broadcast([tensor], opts)
        try:
            work.wait(timedelta(seconds=self.config.timeout_s))
        except Exception as e:
            raise BroadcastTimeout(
                f"weight broadcast to {self.config.inference_workers} inference worker(s) failed or timed out "
                f"after weights.broadcast.timeout_s={self.config.timeout_s:g}s: {e}"
            ) from e

    def _send_bucket(self, header: BucketHeader | None, flat: torch.Tensor | None) -> None:
        raw = header.model_dump_json().encode() if header is not None else b""
        self._broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        if header is None:
            return
        self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))
        self._broadcast(flat)

    def send(self, model: nn.Module, dtype: torch.dtype | None) -> dict[str, float]:
        """Broadcast every HF tensor of ``model``; collective over the trainer's ranks. Returns timings (rank 0)."""
        t0 = time.perf_counter()
        if self.world.is_master and self._group is None:
            self._join()
        t_join = time.perf_counter() - t0
        tensors = hf_state_dict(model, dtype=dtype, device=self.device)
        sent = 0
        for bucket in buckets(tensors, _bucket_bytes(self.config)):
            if not self.world.is_master:
                continue  # the iterator still has to run: gathering FSDP shards is collective
            header, flat = pack(bucket)
            self._send_bucket(header, flat)
            sent += flat.numel() * flat.element_size()
        if self.world.is_master:
            self._send_bucket(None, None)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        total = time.perf_counter() - t0
        return {"join_s": t_join, "send_s": total - t_join, "bytes": float(sent)}


class BroadcastPublisher(FilesystemPublisher):
    """``broadcast.json`` announces each served step; the tensors follow over the group once STABLE is written."""

    def __init__(
        self,
        run_dir: RunDir,
        world: World,
        async_level: int,
        keep_all: bool = False,
        *,
        tokenizer: str,
        config: WeightBroadcastConfig,
    ):
        super().__init__(run_dir, world, async_level, keep_all, tokenizer=tokenizer)
        self.broadcaster = WeightBroadcaster(config, world)

    @classmethod
    def build(cls, run_dir: RunDir, world: World, config: Any, *, keep_all: bool, tokenizer: str, adapter: str | None):
        return cls(run_dir, world, config.async_level, keep_all, tokenizer=tokenizer, config=config.weights.broadcast)

    def write(self, directory: Path, step: int, model: nn.Module, *, durable: bool, serve: bool) -> None:
        if durable or not serve:
            self.write_hf(directory, model)

    def manifest(self, step: int, *, serve: bool) -> BroadcastManifest | None:
        return self.broadcaster.manifest(step) if serve else None

    def deliver(self, step: int, model: nn.Module) -> dict[str, float]:
        return self.broadcaster.send(model, self.dtype)
