"""Messages about weight updates between trainer, orchestrator and inference.

Two ways move a new policy from the trainer to inference, both announced by a ``weights/step_N`` directory with a
STABLE marker that the orchestrator relays through ``POST /update_weights``:

* filesystem: the directory holds HF safetensors; the server loads them.
* broadcast: the directory holds ``broadcast.json`` (a `BroadcastManifest`); the trainer's rank 0 sends the
  tensors over a collective group (NCCL on GPUs, gloo on CPUs) that every inference worker joins. The wire
  protocol, repeated per bucket until a header length of 0:

  1. an int64 tensor of one element: the byte length L of the bucket header (0 ends the update);
  2. a uint8 tensor of L bytes: a `BucketHeader` as JSON;
  3. one flat tensor of ``header.dtype`` and ``header.numel`` elements holding the bucket's tensors back to back.

  Every tensor is broadcast from rank 0 (the trainer); inference workers take ranks 1.. in the order they join.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

BROADCAST_FILE = "broadcast.json"


class WeightUpdateRequest(BaseModel):
    """Body of ``POST /update_weights``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    weight_dir: str
    """Directory written by the trainer; must carry the STABLE marker."""
    step: int | None = None
    """Weight step of that directory, echoed in the response and in the served model's metadata."""
    source: Literal["auto", "filesystem", "broadcast"] = "auto"
    """auto: receive the broadcast when the directory holds ``broadcast.json``, else load its safetensors;
    filesystem: load the safetensors even if a broadcast was announced (e.g. re-serving a checkpoint on resume)."""


class BroadcastManifest(BaseModel):
    """``weights/step_N/broadcast.json``: where and how the trainer broadcasts step N's weights."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    step: int
    """Weight step being broadcast."""
    host: str
    """Address of the rendezvous store the trainer's rank 0 listens on."""
    port: int = Field(ge=1, le=65535)
    """Port of that store."""
    world_size: int = Field(ge=2)
    """Trainer rank 0 plus every inference worker."""
    backend: Literal["nccl", "gloo"]
    """Collective backend: nccl between GPUs, gloo between CPU processes."""
    timeout_s: float = Field(gt=0)
    """Seconds any party waits for the others (joining, or one transfer) before failing."""


class BucketHeader(BaseModel):
    """Layout of one broadcast bucket: ``tensors`` are ``(hf_name, shape, offset)`` into a flat ``dtype`` buffer."""

    model_config = ConfigDict(extra="forbid")

    dtype: str
    numel: int
    tensors: list[tuple[str, list[int], int]]
