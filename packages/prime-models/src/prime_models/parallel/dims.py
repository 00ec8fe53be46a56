"""Parallel dimensions and the device mesh built from them.

Rank layout (outermost first): `dp_replicate`, `dp_shard`, `cp`. Context-parallel ranks are adjacent (one NVLink
island holds a CP group). Expert parallelism borrows ranks instead of adding an axis, as in torchtitan: an EP group is
`ep` consecutive ranks, i.e. `ep / cp` consecutive `dp_shard` ranks with their whole CP groups, so `ep` must be a
multiple of `cp` and `ep / cp` must divide `dp_shard`. Every mesh is a view (`_unflatten`) of one 1-D world mesh:
dense `(dp_replicate, dp_shard_cp)`, data `(dp_replicate, dp_shard, cp)`, sparse `(dp_replicate, dp_shard_mod_ep, ep)`. Tokens are independent in an MoE layer, so it does not matter that the ranks of one EP group
hold different sequences (dp_shard) or different chunks of one sequence (cp).

Who shards what:
* dense parameters: FSDP over `dp_shard * cp` ranks (`dp_shard_cp`), replicated over `dp_replicate` (HSDP);
* expert weights: `E / ep` experts per rank over `ep`, FSDP over the remaining `dp_shard * cp / ep` ranks
  (`dp_shard_mod_ep`), replicated over `dp_replicate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    """Sizes of each parallel axis; `dp_replicate * dp_shard * cp` must equal the world size.

    Attributes:
        dp_replicate: data-parallel replicas (HSDP outer axis); parameters are replicated across it.
        dp_shard: FSDP shard group size (data-parallel ranks inside a replica); -1 means "whatever is left of the
            world size" after dp_replicate and cp.
        cp: context parallel: every row of a micro-batch is split over `cp` adjacent ranks (ring attention).
        tp: tensor parallel (seam only; must be 1 for now).
        ep: expert parallel: each rank holds `num_experts / ep` experts; borrows ranks from `dp_shard * cp`.
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
        if self.tp != 1:
            raise ValueError(f"tp={self.tp}: tp>1 arrives with tensor parallelism; use tp=1")
        for name in ("dp_replicate", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp
            if self.world_size % rest:
                raise ValueError(
                    f"world_size={self.world_size} not divisible by dp_replicate({self.dp_replicate}) * cp({self.cp})"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1, got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) "
                f"!= world_size({self.world_size})"
            )
        if self.ep > 1:
            if self.ep % self.cp:
                raise ValueError(f"ep={self.ep} must be a multiple of cp={self.cp} (EP borrows whole CP groups)")
            if self.dp_shard % (self.ep // self.cp):
                raise ValueError(
                    f"ep={self.ep} must divide dp_shard * cp = {self.dp_shard * self.cp} "
                    f"(ep / cp = {self.ep // self.cp} must divide dp_shard={self.dp_shard})"
                )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batch streams the world trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks each dense parameter is sharded over (`dp_shard * cp`)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_size(self) -> int:
        """Ranks each expert shard is further sharded over (`dp_shard * cp / ep`)."""
        return self.fsdp_size // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_replicate * self.fsdp_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def validate_experts(self, num_experts: int) -> None:
        """Raise unless `num_experts` splits evenly over `ep` (no-op without EP)."""
        if self.ep > 1 and (num_experts == 0 or num_experts % self.ep):
            what = "a dense model has no experts" if num_experts == 0 else f"num_experts={num_experts}"
            raise ValueError(f"ep={self.ep} must divide the number of experts ({what})")

    def validate_seq_len(self, seq_len: int) -> None:
        """Raise unless a row of `seq_len` tokens splits into `2 * cp` equal chunks (load-balanced ring attention)."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(f"cp={self.cp}: seq_len={seq_len} must be divisible by 2 * cp = {2 * self.cp}")

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The device meshes of every axis, all views of one world mesh (so FSDP can compose with the EP shards)."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        hsdp = self.dp_replicate > 1
        dense = world._unflatten(0, (self.dp_replicate, self.fsdp_size), ("dp_replicate", "dp_shard_cp"))
        data = world._unflatten(0, (self.dp_replicate, self.dp_shard, self.cp), ("dp_replicate", "dp_shard", "cp"))
        ep_mesh = expert_fsdp = None
        if self.ep > 1:
            sizes = (self.dp_replicate, self.expert_fsdp_size, self.ep)
            sparse = world._unflatten(0, sizes, ("dp_replicate", "dp_shard_mod_ep", "ep"))
            ep_mesh = sparse["ep"]
            expert_fsdp = sparse["dp_replicate", "dp_shard_mod_ep"] if hsdp else sparse["dp_shard_mod_ep"]
        return ParallelMesh(
            fsdp=dense if hsdp else dense["dp_shard_cp"], cp=data["cp"], ep=ep_mesh, expert_fsdp=expert_fsdp
        )


@dataclass
class ParallelMesh:
    """Device meshes built by `ParallelDims.build_mesh`.

    Attributes:
        fsdp: dense parameters' FSDP mesh: `dp_shard_cp`, or `(dp_replicate, dp_shard_cp)` for HSDP.
        cp: the context-parallel group of this rank (size 1 without CP).
        ep: the expert-parallel group of this rank; None without EP.
        expert_fsdp: expert weights' FSDP mesh (`dp_shard_mod_ep`, or with `dp_replicate` for HSDP); None without EP.
    """

    fsdp: DeviceMesh
    cp: DeviceMesh
    ep: DeviceMesh | None = None
    expert_fsdp: DeviceMesh | None = None
