"""The process group: torchrun (any number of nodes) or a plain single process, CPU (gloo) or CUDA (NCCL)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from prime_core.config import ConfigError


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def allocate_in_expandable_segments(environ: dict[str, str] = os.environ) -> None:
    """Under a memory cap (`gpu_memory_fraction`), grow CUDA memory in expandable segments unless the user configured
    the allocator. With fixed segments the tensors that change size in a step (a 64k row's recomputed layers) strand
    1.7 GiB as reserved but unallocated: under a 16 GiB cap a plan peaking at 15.2 GiB ran out of memory, and ran at
    14.6k tok/s with them. Uncapped, fixed segments stay (measured ~4% faster at 16k). `rl` sets the same for its
    trainer. Read when CUDA initializes, so this runs before the first CUDA call."""
    environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def init_world(device: str = "auto", timeout_s: int = 3600, gpu_memory_fraction: float | None = None) -> World:
    """Initialize torch.distributed from torchrun's env vars, or a one-process group when run directly."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is visible")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        if gpu_memory_fraction is not None:
            allocate_in_expandable_segments()
        torch.cuda.set_device(local_rank)
        if gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, local_rank)
        dev = torch.device("cuda", local_rank)
        # NCCL for CUDA tensors, gloo for the CPU-side collectives (object broadcasts, checkpoint staging).
        backend = "cuda:nccl,cpu:gloo"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=dev if use_cuda else None)
        else:
            if world_size != 1:
                raise ConfigError("WORLD_SIZE > 1 without MASTER_ADDR: start several processes with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev)


def shutdown_world(wait_for_peers: bool = True) -> None:
    """Destroy the process group. After a clean run every rank first waits for the others: a rank that tore its
    gloo pairs down while a peer was still finishing its last collectives aborted (SIGABRT) under CI load. After an
    error nobody waits, since the peers may never arrive."""
    if not dist.is_initialized():
        return
    if wait_for_peers and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over every rank with one collective (float64 so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
