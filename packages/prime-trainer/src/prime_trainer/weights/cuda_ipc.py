"""CUDA IPC transport, trainer side: when trainer and inference share a GPU, rank 0 hands inference its tensors by
CUDA IPC handles (torch's own sharing, ``torch.multiprocessing.reductions``), with no copy through the host or disk.

``weights/step_N`` holds ``cuda_ipc.json`` (`prime_core.schemas.weights.CudaIpcManifest`: the rendezvous store and
the GPU; in a LoRA run also the adapter's name and PEFT config, and the tensors handed over are the adapter's, which
inference serves under that name). Once STABLE is written, rank 0 packs the HF tensors into flat buckets of ``weights.broadcast.bucket_mb``,
publishes each bucket's handle in the store (`CudaIpcBucket`) and waits until every inference worker has copied it
into its model and acknowledged; at most two buckets live on the GPU at a time. All ranks call `CudaIpcSender.send`
(gathering FSDP shards is collective); only rank 0 shares.

vLLM's own IPC engine (``vllm/distributed/weight_transfer/ipc_engine.py``) sends pickled rebuild callables, which
its server refuses unless ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is set; here a handle is plain data
(`CudaIpcHandle`) and the receiver calls torch's ``rebuild_cuda_tensor`` itself.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prime_core.config import ConfigError
from prime_core.config.trainer import WeightBroadcastConfig
from prime_core.run_dir import RunDir
from prime_core.schemas.adapters import AdapterInfo
from prime_core.schemas.weights import CudaIpcAdapter, CudaIpcBucket, CudaIpcHandle, CudaIpcManifest
from prime_models.checkpoint import hf_state_dict
from prime_models.lora import adapter_state_dict, save_adapter, selection
from torch import nn

from prime_trainer.weights.base import buckets, pack
from prime_trainer.weights.filesystem import FilesystemPublisher
from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")
IN_FLIGHT = 2
"""Buckets shared at once: the next one is packed while inference copies the previous one."""
POLL_S = (0.0002, 0.01)
"""First and longest pause between checks for acknowledgements (doubling): a take of a few milliseconds is seen
within as much again, a wait of seconds (inference busy) costs 100 cheap checks a second."""


class CudaIpcTimeout(RuntimeError):
    """Inference did not take a bucket within ``weights.broadcast.timeout_s``, or reported a failure."""


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(bytes(raw)).decode()


def share(flat: torch.Tensor) -> CudaIpcHandle:
    """The CUDA IPC handle of ``flat``'s storage (torch's ``_share_cuda_``, what ``reduce_tensor`` sends) as plain
    data. The storage stays allocated until every receiver has released it (torch's IPC reference counter)."""
    _, handle, size, offset, counter, counter_offset, event, event_sync = flat.untyped_storage()._share_cuda_()
    return CudaIpcHandle(
        storage_handle=_b64(handle),
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=_b64(counter),
        ref_counter_offset=counter_offset,
        event_handle=_b64(event) if event else None,
        event_sync_required=bool(event_sync),
    )


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU (stable across processes, unlike an index under CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else device.type


@contextlib.contextmanager
def shareable_allocations() -> Iterator[None]:
    """Allocate from plain ``cudaMalloc`` segments: an expandable segment (``rl`` sets expandable_segments for the
    trainer) would be shared by a file descriptor that the receiver takes with ``pidfd_getfd``, which ptrace
    restrictions between sibling processes refuse."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    # torch >= 2.10 warns (FutureWarning) on the cuda-specific setter; older ones lack the accelerator one.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    if expandable:
        setter("expandable_segments:False")
    try:
        yield
    finally:
        if expandable:
            setter("expandable_segments:True")


def key(step: int, *parts: object) -> str:
    """Store keys of step ``step`` (under the ``prime-ipc/`` prefix of the store)."""
    return "/".join(str(p) for p in (step, *parts))


class CudaIpcSender:
    """Rank 0 owns a rendezvous store (opened at the first manifest) that inference workers connect to."""

    def __init__(self, config: WeightBroadcastConfig, world: World):
        self.config = config
        self.world = world
        self.device = world.device
        self.store: Any = None

    def _open_store(self) -> Any:
        if self.store is None:
            c = self.config
            try:
                master = dist.TCPStore(c.host, c.port, None, True, timeout=timedelta(seconds=c.timeout_s))
            except Exception as e:  # OSError when the port is taken
                raise CudaIpcTimeout(
                    f"cuda_ipc: cannot listen on {c.host}:{c.port} (weights.broadcast.port): {e}"
                ) from e
            self.store = dist.PrefixStore("prime-ipc", master)
        return self.store

    def manifest(self, step: int, adapter: CudaIpcAdapter | None = None) -> CudaIpcManifest:
        self._open_store()
        c = self.config
        return CudaIpcManifest(step=step, host=c.host, port=c.port, num_workers=c.inference_workers,
                               gpu_uuid=gpu_uuid(self.device), timeout_s=c.timeout_s, adapter=adapter)  # fmt: skip

    def _wait_taken(self, step: int, index: int) -> None:
        """Until every worker acknowledged bucket ``index`` (or one reported a failure, or the time is up). Checked,
        not waited for with a short timeout: each timed-out store wait logs two C++ warnings, 40 lines a second in
        the trainer's log for as long as inference is busy."""
        keys = [key(step, "taken", index, w) for w in range(self.config.inference_workers)]
        deadline = time.monotonic() + self.config.timeout_s
        pause, longest = POLL_S
        while not self.store.check(keys):
            time.sleep(pause)
            pause = min(2 * pause, longest)
            if self.store.check([key(step, "failed")]):
                failure = self.store.get(key(step, "failed")).decode(errors="replace")
                raise CudaIpcTimeout(f"cuda_ipc: inference failed to take bucket {index} of step {step}: {failure}")
            if time.monotonic() > deadline:
                c = self.config
                raise CudaIpcTimeout(
                    f"cuda_ipc: {c.inference_workers} inference worker(s) did not take bucket {index} of step {step} "
                    f"from the store at {c.host}:{c.port} within weights.broadcast.timeout_s={c.timeout_s:g}s; are "
                    "the orchestrator and inference running, on this GPU?"
                )

    def _offer(self, step: int, bucket: CudaIpcBucket) -> None:
        self.store.set(key(step, "bucket", bucket.index), bucket.model_dump_json())

    def send(
        self, model: nn.Module, dtype: torch.dtype | None, step: int, tensors: Iterator | None = None
    ) -> dict[str, float]:
        """Hand over every HF tensor of ``model`` (or the (name, tensor) pairs of ``tensors``, e.g. an adapter's);
        collective over the trainer's ranks. Returns timings (rank 0)."""
        t0 = time.perf_counter()
        shared: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        index = sent = 0
        if tensors is None:
            tensors = hf_state_dict(model, dtype=dtype, device=self.device)
        try:
            for bucket in buckets(tensors, self._bucket_bytes()):
                if not self.world.is_master:
                    continue  # the iterator still has to run: gathering FSDP shards is collective
                if len(shared) >= IN_FLIGHT:
                    self._wait_taken(step, shared.popleft()[0])
                with shareable_allocations():
                    header, flat = pack(bucket)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the bytes are there before the handle is
                self._offer(step, CudaIpcBucket(index=index, dtype=header.dtype, numel=header.numel,
                                                tensors=header.tensors, handle=share(flat)))  # fmt: skip
                shared.append((index, flat))
                sent += flat.numel() * flat.element_size()
                index += 1
            if self.world.is_master:
                self._offer(step, CudaIpcBucket(index=index))
                while shared:
                    self._wait_taken(step, shared.popleft()[0])
                self._wait_taken(step, index)  # the end was read too: the step's keys can go
        except BaseException as e:
            if self.world.is_master and self.store is not None:
                with contextlib.suppress(Exception):  # tell the receivers, who would otherwise wait their timeout
                    self._offer(step, CudaIpcBucket(index=index, error=f"{type(e).__name__}: {e}"[:2000]))
            raise
        finally:
            shared.clear()
            if self.world.is_master and self.device.type == "cuda":
                torch.cuda.ipc_collect()  # blocks the receivers released go back to the allocator
        if self.world.is_master:
            self._forget(step, index)
        return {"send_s": time.perf_counter() - t0, "bytes": float(sent)}

    def _bucket_bytes(self) -> int:
        return self.config.bucket_mb * 2**20

    def _forget(self, step: int, num_buckets: int) -> None:
        keys = [key(step, "workers")]
        for i in range(num_buckets + 1):
            keys += [key(step, "bucket", i)] + [key(step, "taken", i, w) for w in range(self.config.inference_workers)]
        for k in keys:
            with contextlib.suppress(Exception):
                self.store.delete_key(k)


class CudaIpcPublisher(FilesystemPublisher):
    """``cuda_ipc.json`` announces each served step; the handles follow through the store once STABLE is written.
    With ``adapter`` (a LoRA run) the adapter's tensors are handed over, and its PEFT files written where files are."""

    def __init__(
        self,
        run_dir: RunDir,
        world: World,
        async_level: int,
        keep_all: bool = False,
        *,
        tokenizer: str,
        config: WeightBroadcastConfig,
        adapter: str | None = None,
        base_model: str | None = None,
    ):
        super().__init__(run_dir, world, async_level, keep_all, tokenizer=tokenizer)
        self.sender = CudaIpcSender(config, world)
        self.adapter = adapter
        self.base_model = base_model
        self.peft_config: dict | None = None

    @classmethod
    def build(cls, run_dir: RunDir, world: World, config: Any, *, keep_all: bool, tokenizer: str, adapter: str | None):
        if world.device.type != "cuda":
            raise ConfigError(
                f"weights.broadcast.type = 'cuda_ipc' shares GPU memory; the trainer runs on {world.device.type}: "
                "use 'nccl' (gloo on CPU) or 'filesystem'"
            )
        return cls(run_dir, world, config.async_level, keep_all, tokenizer=tokenizer, config=config.weights.broadcast,
                   adapter=adapter, base_model=config.model.name)  # fmt: skip

    def write(self, directory: Path, step: int, model: nn.Module, *, durable: bool, serve: bool) -> None:
        if self.adapter is not None:
            self.peft_config = selection(model).specs[self.adapter].peft_config(self.base_model)
        if not (durable or not serve):
            return
        if self.adapter is not None:
            save_adapter(model, self.adapter, directory, base_model=self.base_model, dtype=self.dtype)
        else:
            self.write_hf(directory, model)

    def manifest(self, step: int, *, serve: bool) -> CudaIpcManifest | AdapterInfo | None:
        if self.adapter is None:
            return self.sender.manifest(step) if serve else None
        if not serve:  # only the files: the adapter transport's own announcement
            return AdapterInfo(name=self.adapter, step=step, base_model=self.base_model)
        assert self.peft_config is not None, "write() runs before manifest()"
        adapter = CudaIpcAdapter(name=self.adapter, base_model=self.base_model, peft_config=self.peft_config)
        return self.sender.manifest(step, adapter)

    def deliver(self, step: int, model: nn.Module) -> dict[str, float]:
        tensors = None
        if self.adapter is not None:
            tensors = adapter_state_dict(model, self.adapter, dtype=self.dtype, device=self.world.device)
        return self.sender.send(model, self.dtype, step, tensors)
