"""Base class of every config: typed, documented, closed to unknown keys."""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_WAIT_S = 7 * 24 * 3600


NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4096


def path_length_error(value: str) -> str | None:
    """Why ``value`` cannot name a file on Linux (a part longer than NAME_MAX, or the whole longer than PATH_MAX), or
    None. Python's ``Path.exists`` raises on such a path (ENAMETOOLONG) instead of answering False."""
    size = len(value.encode(errors="surrogateescape"))
    if size >= PATH_MAX_BYTES:
        return f"is {size} bytes long: a path holds fewer than {PATH_MAX_BYTES}"
    longest = max((part for part in value.split("/")), key=lambda part: len(part.encode(errors="surrogateescape")))
    if (part_size := len(longest.encode(errors="surrogateescape"))) > NAME_MAX_BYTES:
        return f"has a part of {part_size} bytes ({longest[:24]}...): a file name holds at most {NAME_MAX_BYTES}"
    return None


def clipped_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to about ``limit`` characters: an error line echoes what the user gave, not megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def control_character_error(value: str) -> str | None:
    """Why a value that ends up in a file name or a shell script must not hold ``value``'s control character."""
    if (found := _CONTROL.search(value)) is None:
        return None
    return f"holds the control character {found.group()!r}, which a path or script line cannot carry"


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

    @field_validator("*", mode="after")
    @classmethod
    def _paths_printable_and_waits_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        # A NUL in a path fails in os.stat with a traceback; a newline splits the sbatch script's lines (``#SBATCH
        # --output=<dir>``), so the rest of the path runs as a command.
        paths = value if isinstance(value, list | tuple) else [value]
        for path in paths:
            if isinstance(path, PurePath) and (
                why := control_character_error(str(path)) or path_length_error(str(path))
            ):
                raise ValueError(f"the path {why}")
        # A wait of 1e12 s is no bound, and past threading.TIMEOUT_MAX a lock's acquire raises OverflowError.
        name = info.field_name or ""
        is_wait = "timeout" in name or name.endswith("_s")
        if is_wait and isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_WAIT_S:
            raise ValueError(f"a wait of {value:g} s is no bound: at most {MAX_WAIT_S} s (7 days)")
        return value

    def derive(self, **changes: Any) -> Self:
        """A copy with ``changes`` (field name -> value; a sub-section is given as a derived section) applied and
        the whole section validated again, so a derived config obeys every rule a user's would. How the launcher
        fills in what one process's config needs from another's; a misspelt field is a ``TypeError``."""
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        return type(self).model_validate(self.model_copy(update=changes).model_dump())
