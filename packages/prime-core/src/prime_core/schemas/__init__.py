"""Data schemas handed between processes."""

from prime_core.schemas.metrics import MetricsRecord
from prime_core.schemas.microbatch import (
    MICROBATCH_SCHEMA_VERSION,
    MicroBatch,
    RolloutBatchMeta,
    read_microbatches,
    write_microbatches,
)
from prime_core.schemas.weights import WeightUpdateRequest

__all__ = [
    "MICROBATCH_SCHEMA_VERSION",
    "MetricsRecord",
    "MicroBatch",
    "RolloutBatchMeta",
    "WeightUpdateRequest",
    "read_microbatches",
    "write_microbatches",
]
