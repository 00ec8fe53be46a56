"""Parallel dimensions and the device mesh built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    """Sizes of each parallel axis; their product must equal the world size.

    Attributes:
        dp_replicate: data-parallel replicas (HSDP outer axis); parameters are replicated across it.
        dp_shard: FSDP shard group size; -1 means "whatever is left of the world size".
        cp: context parallel (seam only; must be 1 for now).
        tp: tensor parallel (seam only; must be 1 for now).
        ep: expert parallel (seam only; must be 1 for now).
        world_size: defaults to `torch.distributed`'s world size, or 1 when no process group exists.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: int | None = None

    def __post_init__(self):
        if self.world_size is None:
            self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.ep != 1:
            raise ValueError(f"ep={self.ep}: ep>1 arrives with expert parallelism; use ep=1")
        if self.cp != 1:
            raise ValueError(f"cp={self.cp}: cp>1 arrives with context parallelism; use cp=1")
        if self.tp != 1:
            raise ValueError(f"tp={self.tp}: tp>1 arrives with tensor parallelism; use tp=1")
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(f"world_size={self.world_size} not divisible by dp_replicate={self.dp_replicate}")
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1, got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) != world_size({self.world_size})"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """2D mesh (dp_replicate, dp_shard); FSDP uses both axes (HSDP) when dp_replicate > 1."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]
