"""Base class of every config: typed, documented, closed to unknown keys."""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A user error in configuration input; the message is one line meant for the console."""


class BaseConfig(BaseModel):
    """A config section. Every field carries a docstring; unknown keys are errors."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
        # inf and nan are never meant: an infinite timeout is an unbounded wait, an infinite lr or temperature a
        # run that produces garbage, and nan fails every comparison, so it slips past the ge/le bounds.
        allow_inf_nan=False,
    )

    def derive(self, **changes: Any) -> Self:
        """A copy with ``changes`` (field name -> value; a sub-section is given as a derived section) applied and
        the whole section validated again, so a derived config obeys every rule a user's would. How the launcher
        fills in what one process's config needs from another's; a misspelt field is a ``TypeError``."""
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        return type(self).model_validate(self.model_copy(update=changes).model_dump())
