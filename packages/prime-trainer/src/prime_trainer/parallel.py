"""The trainer's parallel layout (FSDP/HSDP, expert and context parallelism) and the CP handling of micro-batches.

Context parallelism in the trainer: the orchestrator writes one file per trainer rank as usual; the ranks of a CP group
pool their micro-batches (`pool_cp_micro_batches`) and then process every pooled micro-batch together, each rank
running the model on its share of every row (`prime_trainer.model.token_logprobs`) and gathering the per-token
log-probs back into full rows. The loss and its statistics are then computed on full rows, identically on every rank
of the group, which is why step code divides the loss and the all-reduced sums by `cp` (`TrainerLayout.cp_size`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from prime_core.config import ConfigError
from prime_core.config.shared import ModelConfig
from prime_core.config.trainer import ParallelConfig
from prime_core.schemas.microbatch import MicroBatch
from prime_models import ParallelDims
from prime_models.parallel import ParallelMesh
from prime_models.parallel.context_parallel import ContextParallel

from prime_trainer.world import World


@dataclass
class TrainerLayout:
    dims: ParallelDims
    mesh: ParallelMesh | None
    """None when nothing is parallel (one CPU process)."""
    ep_dispatcher: str = "torch"
    context_parallel: ContextParallel | None = None
    """This rank's CP group; None without context parallelism."""

    @property
    def cp_size(self) -> int:
        return self.dims.cp


def parallel_dims(world: World, parallel: ParallelConfig, model: ModelConfig) -> ParallelDims:
    """Axis sizes from the config; impossible layouts fail with the config fields at fault."""
    ws, ep, cp = world.world_size, model.ep, model.cp
    if ws % cp:
        raise ConfigError(f"model.cp={cp} must divide the world size ({ws} ranks)")
    dp = ws // cp
    if parallel.dp_shard != -1 and dp % parallel.dp_shard:
        raise ConfigError(f"parallel.dp_shard={parallel.dp_shard} must divide world size / model.cp = {dp}")
    dp_shard = dp if parallel.dp_shard == -1 else parallel.dp_shard
    if ep > 1 and ep % cp:
        raise ConfigError(f"model.ep={ep} must be a multiple of model.cp={cp} (an EP group spans whole CP groups)")
    if ep > 1 and (dp_shard * cp) % ep:
        raise ConfigError(
            f"model.ep={ep} must divide parallel.dp_shard * model.cp = {dp_shard * cp} (EP borrows data-parallel ranks)"
        )
    return ParallelDims(dp_replicate=dp // dp_shard, dp_shard=dp_shard, cp=cp, ep=ep, world_size=ws)


def validate_model(dims: ParallelDims, hf_config: dict, seq_len: int | None) -> None:
    """Model- and data-dependent checks of the layout (before any weight is loaded)."""
    num_experts = int(hf_config.get("num_experts") or hf_config.get("n_routed_experts") or 0)
    if dims.ep > 1 and not num_experts:
        raise ConfigError(
            f"model.ep={dims.ep} needs a mixture-of-experts model ({hf_config.get('model_type')} is dense)"
        )
    if dims.ep > 1 and num_experts % dims.ep:
        raise ConfigError(f"model.ep={dims.ep} must divide the number of experts ({num_experts})")
    if dims.cp > 1 and seq_len is not None and seq_len % (2 * dims.cp):
        raise ConfigError(f"model.cp={dims.cp}: seq_len={seq_len} must be divisible by 2 * cp = {2 * dims.cp}")


def validate_cuda_graphs(parallel: ParallelConfig, world: World, hf_config: dict) -> None:
    """What ``parallel.cuda_graphs`` cannot serve and only the world or the model's config tells (the rest is checked
    when the config is loaded)."""
    if not parallel.cuda_graphs:
        return
    num_experts = int(hf_config.get("num_experts") or hf_config.get("n_routed_experts") or 0)
    clash = (
        f"{world.world_size} ranks (one rank only)" if world.world_size > 1
        else f"device {world.device.type} (CUDA only)" if world.device.type != "cuda"
        else "MoE models" if num_experts
        else "vision-language models" if "vision_config" in hf_config
        else None
    )  # fmt: skip
    if clash is not None:
        raise ConfigError(f"parallel.cuda_graphs does not serve {clash}: unset it")


def build_layout(world: World, parallel: ParallelConfig, model: ModelConfig) -> TrainerLayout:
    """Validated axis sizes plus, when anything is parallel, the device meshes (a collective: every rank calls it)."""
    dims = parallel_dims(world, parallel, model)
    if world.world_size == 1:
        return TrainerLayout(dims, None, model.ep_dispatcher)
    mesh = dims.build_mesh(world.device.type)
    cp = ContextParallel(mesh.cp) if dims.cp > 1 else None
    return TrainerLayout(dims, mesh, model.ep_dispatcher, cp)


def pool_cp_micro_batches(micro_batches: list[MicroBatch], layout: TrainerLayout | None) -> list[MicroBatch]:
    """Every rank of a CP group gets the micro-batches of all of them (in CP-rank order); unchanged without CP.

    Every rank must pass the same number of micro-batches (pad first): the pooled lists are then equally long too.
    """
    if layout is None or layout.context_parallel is None:
        return micro_batches
    gathered: list[list[MicroBatch] | None] = [None] * layout.cp_size
    dist.all_gather_object(gathered, micro_batches, group=layout.context_parallel.group)
    return [mb for part in gathered for mb in part]
