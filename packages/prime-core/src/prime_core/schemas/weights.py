"""Messages about weight updates between trainer, orchestrator and inference."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WeightUpdateRequest(BaseModel):
    """Body of ``POST /update_weights``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    weight_dir: str
    """HF-format directory written by the trainer; must carry the STABLE marker."""
    step: int | None = None
    """Weight step of that directory, echoed in the response and in the served model's metadata."""
