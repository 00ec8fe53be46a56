"""Base class of every config: typed, documented, closed to unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class BaseConfig(BaseModel):
    """A config section. Every field carries a docstring; unknown keys are errors."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
    )
