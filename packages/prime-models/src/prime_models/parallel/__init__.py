"""Model-agnostic parallelism helpers: parallel dims/mesh, activation checkpointing, FSDP2."""

from prime_models.parallel.activation_checkpoint import apply_activation_checkpointing
from prime_models.parallel.dims import ParallelDims
from prime_models.parallel.fsdp import apply_fsdp, default_mp_policy
from prime_models.parallel.parallelize import parallelize_transformer

__all__ = [
    "ParallelDims",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "default_mp_policy",
    "parallelize_transformer",
]
