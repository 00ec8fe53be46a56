"""LoRA adapter directories and the admin messages that load them into inference.

An adapter directory is PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM and
``peft`` load. The trainer adds ``prime_adapter.json`` (`AdapterInfo`) naming the adapter, so that
``POST /update_weights`` with such a directory knows which served adapter it replaces.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_INFO = "prime_adapter.json"
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a PEFT LoRA adapter (rather than full HF weights)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


class AdapterInfo(BaseModel):
    """``prime_adapter.json``: which adapter a trainer-written directory holds (the adapter transport's manifest, see
    `prime_core.schemas.weights`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    file: ClassVar[str | None] = ADAPTER_INFO
    repeatable: ClassVar[bool] = True

    type: Literal["adapter"] = "adapter"
    """Transport: a PEFT adapter in the directory."""
    name: str = Field(pattern=f"^{ADAPTER_NAME_PATTERN}$")
    """Adapter name: the ``model`` that requests use to be served by it."""
    step: int | None = None
    """Weight step the adapter was published at."""
    base_model: str | None = None
    """The base model it was trained on (``model.name``)."""


class LoadLoRAAdapterRequest(BaseModel):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's API)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lora_name: str = Field(pattern=f"^{ADAPTER_NAME_PATTERN}$")
    """Name to serve the adapter under (requests select it with ``"model": lora_name``)."""
    lora_path: str
    """Adapter directory (PEFT format); an adapter already loaded under ``lora_name`` is replaced."""
    load_inplace: bool = True
    """Replace an adapter of the same name (vLLM's flag; prime always reloads in place)."""
    step: int | None = Field(default=None, ge=0)
    """Weight step of the adapter, reported in ``/v1/models`` and response headers (prime extension)."""


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's API)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lora_name: str = Field(pattern=f"^{ADAPTER_NAME_PATTERN}$")
    """Name of the adapter to drop (no other name can be loaded)."""
    lora_int_id: int | None = None
    """Accepted for vLLM compatibility and ignored."""
