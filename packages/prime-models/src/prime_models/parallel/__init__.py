"""Model-agnostic parallelism helpers: dims/meshes, expert and context parallelism, activation checkpointing, FSDP2."""

from prime_models.parallel.activation_checkpoint import apply_activation_checkpointing
from prime_models.parallel.context_parallel import ContextParallel
from prime_models.parallel.dims import ParallelDims, ParallelMesh
from prime_models.parallel.expert_parallel import apply_expert_parallel
from prime_models.parallel.fsdp import apply_fsdp, default_mp_policy
from prime_models.parallel.parallelize import parallelize_transformer

__all__ = [
    "ContextParallel",
    "ParallelDims",
    "ParallelMesh",
    "apply_activation_checkpointing",
    "apply_expert_parallel",
    "apply_fsdp",
    "default_mp_policy",
    "parallelize_transformer",
]
