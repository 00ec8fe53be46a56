"""One line of ``metrics.jsonl``."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field


class MetricsRecord(BaseModel):
    """A step's metrics from one process."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    step: int
    """Training step the values belong to."""
    process: str
    """Writer: ``trainer``, ``orchestrator``, ``sft``, ``eval``."""
    time: float = Field(default_factory=time.time)
    """Unix time of the record."""
    values: dict[str, float | int | str | None] = Field(default_factory=dict)
    """Metric name to value, names like ``loss/mean`` or ``reward/mean``."""
