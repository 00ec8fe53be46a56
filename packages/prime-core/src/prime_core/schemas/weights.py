"""Weight transports: what a ``weights/step_N`` directory announces, and the messages that load it into inference.

The trainer announces step N's weights by a ``weights/step_N`` directory with a STABLE marker; the orchestrator
relays it to every inference server with ``POST /update_weights`` (`WeightUpdateRequest`). What the directory
announces is one typed manifest (`WeightManifest`, discriminated on ``type``), read with `read_manifest`:

* ``filesystem`` (`FilesystemManifest`): the directory holds HF safetensors + ``config.json``; no manifest file.
* ``broadcast`` (`BroadcastManifest`, ``broadcast.json``): the trainer's rank 0 sends the tensors once over a
  collective group (NCCL between GPUs, gloo between CPU processes) that every inference worker joins.
* ``adapter`` (`AdapterInfo` of `prime_core.schemas.adapters`, ``prime_adapter.json``): the directory holds a PEFT
  LoRA adapter and names the served adapter it replaces.
* ``cuda_ipc`` (`CudaIpcManifest`, ``cuda_ipc.json``): trainer and inference share a GPU; the trainer's rank 0 hands
  each bucket of tensors over as a CUDA IPC handle (`CudaIpcBucket`, through the rendezvous store the manifest
  names), inference copies it into its model and acknowledges, and only then is the buffer reused or freed. With
  ``adapter`` set (`CudaIpcAdapter`) the tensors are a LoRA adapter's, PEFT-keyed, which inference serves under
  its name instead of loading them into the base model.

Each manifest class declares ``file`` (the file announcing it; None for plain HF files) and ``repeatable``: whether
the directory itself holds the weights, so that loading it can be repeated (a retried request after a failure or a
timeout, a resumed run re-serving a checkpoint step). A one-time transfer (``repeatable = False``) is asked for
once, of all servers together, and never retried: the sender does not send again. The trainer side of a transport
is ``prime_trainer.weights.<type>``, the inference side ``prime_inference.weights.<type>``.

Broadcast wire protocol, repeated per bucket until a header length of 0:

1. an int64 tensor of one element: the byte length L of the bucket header (0 ends the update);
2. a uint8 tensor of L bytes: a `BucketHeader` as JSON;
3. one flat tensor of ``header.dtype`` and ``header.numel`` elements holding the bucket's tensors back to back.

Every tensor is broadcast from rank 0 (the trainer); inference workers take ranks 1.. in the order they join.

Whatever the transport, the trainer records the CRC-32 of every file it wrote into the directory in
``checksums.json`` (`CHECKSUMS_FILE`) before STABLE, and every reader of the files checks them (`verify_weights`):
random bytes written over part of a shard after the trainer wrote it are finite values, which no other check sees.
The collective and CUDA IPC hand-overs carry no files, so nothing of theirs is summed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from prime_core.io import UnreadableFile, atomic_write_json, atomic_write_text, file_crc32, read_regular
from prime_core.schemas.adapters import ADAPTER_INFO, ADAPTER_NAME_PATTERN, AdapterInfo, is_adapter_dir

BROADCAST_FILE = "broadcast.json"
MAX_MANIFEST_BYTES = 16 * 2**20
"""A manifest is a few KiB; a larger file is refused before it is parsed."""
CHECKSUMS_FILE = "checksums.json"
"""``weights/step_N/checksums.json``: file name -> CRC-32 (8 hex digits) of every file the trainer wrote there."""


class Manifest(Protocol):
    """What every transport's manifest declares (pydantic models discriminated on ``type``)."""

    file: ClassVar[str | None]
    """The file in ``weights/step_N`` that announces the transport; None: the directory's HF files themselves."""
    repeatable: ClassVar[bool]
    """The directory itself holds the weights: loading it may be repeated (retried, re-served on resume)."""
    type: str

    def model_dump(self, **kwargs: Any) -> dict[str, Any]: ...


class FilesystemManifest(BaseModel):
    """A directory of HF safetensors (``config.json`` + ``*.safetensors``), announced by no file of its own."""

    model_config = ConfigDict(extra="forbid")

    file: ClassVar[str | None] = None
    repeatable: ClassVar[bool] = True

    type: Literal["filesystem"] = "filesystem"
    """Transport: the directory's own HF files."""


class BroadcastManifest(BaseModel):
    """``weights/step_N/broadcast.json``: where and how the trainer broadcasts step N's weights."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    file: ClassVar[str | None] = BROADCAST_FILE
    repeatable: ClassVar[bool] = False

    type: Literal["broadcast"] = "broadcast"
    """Transport: a collective broadcast from trainer rank 0."""
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


class CudaIpcAdapter(BaseModel):
    """The LoRA adapter a ``cuda_ipc`` step hands over instead of full weights."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=f"^{ADAPTER_NAME_PATTERN}$")
    """The served adapter the tensors replace (requests name it as their ``model``)."""
    base_model: str | None = None
    """The base model it was trained on (``model.name``)."""
    peft_config: dict[str, Any]
    """Its ``adapter_config.json`` (PEFT's LoRA settings: rank, alpha, target modules)."""


class CudaIpcManifest(BaseModel):
    """``weights/step_N/cuda_ipc.json``: where the trainer hands over step N's weights by CUDA IPC handles."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    file: ClassVar[str | None] = "cuda_ipc.json"
    repeatable: ClassVar[bool] = False

    type: Literal["cuda_ipc"] = "cuda_ipc"
    """Transport: CUDA IPC handles on a GPU that trainer and inference share."""
    step: int
    """Weight step being handed over."""
    host: str
    """Address of the rendezvous store (a ``torch.distributed.TCPStore``) on the trainer's rank 0."""
    port: int = Field(ge=1, le=65535)
    """Port of that store."""
    num_workers: int = Field(ge=1)
    """Inference workers that take every bucket; the trainer frees a bucket once all of them acknowledged it."""
    gpu_uuid: str
    """The physical GPU (``torch.cuda.get_device_properties(i).uuid``) holding the buffers; a worker elsewhere
    refuses the transfer."""
    timeout_s: float = Field(gt=0)
    """Seconds either side waits for the other (a bucket, an acknowledgement) before failing."""
    adapter: CudaIpcAdapter | None = None
    """Set when the tensors are this LoRA adapter's (PEFT keys, ``base_model.model.<module>.lora_A/B.weight``)."""


class CudaIpcHandle(BaseModel):
    """One CUDA allocation shared by torch's IPC (``UntypedStorage._share_cuda_``), as plain data: bytes are base64,
    so no pickle crosses the process boundary."""

    model_config = ConfigDict(extra="forbid")

    storage_handle: str
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str
    ref_counter_offset: int = Field(ge=0)
    event_handle: str | None
    event_sync_required: bool


class CudaIpcBucket(BaseModel):
    """One bucket of a CUDA IPC hand-over: ``tensors`` are ``(hf_name, shape, offset)`` into a flat ``dtype`` buffer
    of ``numel`` elements shared by ``handle``. ``index`` counts the step's buckets from 0; ``handle`` None ends the
    step (``index`` is then the number of buckets), with ``error`` set when the trainer failed."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    dtype: str = ""
    numel: int = Field(default=0, ge=0)
    tensors: list[tuple[str, list[int], int]] = Field(default_factory=list)
    handle: CudaIpcHandle | None = None
    error: str | None = None


MANIFESTS: tuple[type[BaseModel], ...] = (FilesystemManifest, BroadcastManifest, AdapterInfo, CudaIpcManifest)
"""Every transport's manifest; a new transport adds its class here (its ``type`` names its modules on both sides)."""
TRANSPORTS: tuple[str, ...] = tuple(m.model_fields["type"].default for m in MANIFESTS)
ANNOUNCED = tuple(m for m in MANIFESTS if m.file is not None)
"""Manifests announced by a file in the directory (the others are the directory's content itself)."""
WeightManifest = Annotated[Union[MANIFESTS], Field(discriminator="type")]  # noqa: UP007 (a union of a tuple)
_MANIFEST: TypeAdapter[Any] = TypeAdapter(WeightManifest)


class WeightUpdateRequest(BaseModel):
    """Body of ``POST /update_weights``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    weight_dir: str
    """Directory written by the trainer; must carry the STABLE marker."""
    step: int | None = None
    """Weight step of that directory, echoed in the response and in the served model's metadata."""
    source: str = "auto"
    """auto: the transport the directory announces; filesystem: only what the directory itself holds (a one-time
    transfer's manifest is ignored and its HF files, or a LoRA adapter's PEFT files, are loaded, e.g. a checkpoint
    step re-served on resume); another
    transport's name (``broadcast``, ``adapter``): refuse a directory that announces something else."""

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value != "auto" and value not in TRANSPORTS:
            raise ValueError(f"source must be auto or one of {', '.join(TRANSPORTS)}, got {value!r}")
        return value


def parse_manifest(data: dict[str, Any] | Manifest) -> Manifest:
    """A manifest from its JSON form (e.g. after crossing an RPC boundary)."""
    return data if isinstance(data, MANIFESTS) else _MANIFEST.validate_python(data)


def read_manifest(weight_dir: str | os.PathLike, source: str = "auto") -> Manifest:
    """What ``weight_dir`` announces (see the module docstring for ``source``); ValueError names the bad file."""
    directory = Path(weight_dir)
    found = [cls for cls in ANNOUNCED if (directory / cls.file).is_file()]
    if len(found) > 1:
        raise ValueError(f"{directory} announces several transports: {', '.join(c.file for c in found)}")
    if found:
        manifest = _read(directory / found[0].file, found[0])
    elif is_adapter_dir(directory):
        raise ValueError(
            f"{directory} holds a LoRA adapter without {ADAPTER_INFO} naming it: "
            "load it with POST /v1/load_lora_adapter {lora_name, lora_path}"
        )
    else:
        manifest = FilesystemManifest()
    if source == "filesystem" and not manifest.repeatable:
        return held_files(manifest)
    if source not in ("auto", "filesystem", manifest.type):
        raise ValueError(f"{directory} announces {manifest.type} weights, not {source}")
    return manifest


def held_files(manifest: Manifest) -> Manifest:
    """What the directory of a one-time transfer holds itself, when it holds anything (checkpoint steps, the final
    step): a LoRA adapter step's PEFT files (`AdapterInfo`), else HF files."""
    adapter = getattr(manifest, "adapter", None)
    if isinstance(adapter, CudaIpcAdapter):
        return AdapterInfo(name=adapter.name, step=getattr(manifest, "step", None), base_model=adapter.base_model)
    return FilesystemManifest()


def _read(path: Path, cls: type[BaseModel]) -> Manifest:
    try:  # checked on the opened file: a FIFO (size 0) passed a check by path, then blocked the server in open
        return cls.model_validate_json(read_regular(path, "a weight manifest", MAX_MANIFEST_BYTES))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{path} is not a valid {cls.model_fields['type'].default} manifest: {problems}") from None
    except UnreadableFile as e:  # names the path already
        raise ValueError(f"{path} is not a valid {cls.model_fields['type'].default} manifest: "
                         f"{str(e).removeprefix(f'{path}: ')}") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a valid {cls.model_fields['type'].default} manifest: {e}") from None


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest`` into ``directory`` under its file name (atomically); returns the file."""
    assert manifest.file is not None, f"a {manifest.type} manifest is not written to a file"
    path = Path(directory) / manifest.file
    # The file's name says the transport: on disk the manifest stays what it was before ``type`` existed.
    atomic_write_text(path, manifest.model_dump_json(indent=2, exclude={"type"}) + "\n")
    return path


class ChangedWeights(ValueError):
    """A file of a published weights step that does not hold what the trainer wrote (its checksum differs)."""


def write_checksums(directory: str | os.PathLike, written: dict[str, str]) -> dict[str, str]:
    """Record the CRC-32 of every file in ``directory`` (before its STABLE): ``written`` holds those summed from the
    bytes on their way to the file; the others (configs, tokenizer, a manifest: small) are read back."""
    directory = Path(directory)
    sums = {
        f.name: written.get(f.name) or file_crc32(f)
        for f in sorted(directory.iterdir())
        if f.is_file() and not f.is_symlink() and f.name != CHECKSUMS_FILE
    }
    atomic_write_json(directory / CHECKSUMS_FILE, sums)
    return sums


def verify_weights(weight_dir: str | os.PathLike, step: int | None = None) -> None:
    """Every file ``checksums.json`` of ``weight_dir`` names must hold what the trainer wrote; `ChangedWeights` names
    the first that does not, in one line. A directory of an older writer (no ``checksums.json``) is not checked.
    Costs one read of the files (zlib's CRC-32: about 0.15-0.3 s per GiB on a CPU core, docs/trainer.md)."""
    directory = Path(weight_dir)
    what = f"weights step {step}" if step is not None else "weights"
    sums_file = directory / CHECKSUMS_FILE
    if not sums_file.is_symlink() and not sums_file.exists():
        return
    try:
        sums = json.loads(read_regular(sums_file, "a weights step's checksums", MAX_MANIFEST_BYTES))
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError("not an object of file name -> CRC-32")
    except (OSError, UnreadableFile, ValueError) as e:
        raise ChangedWeights(f"{what}: {sums_file} is unreadable ({str(e).removeprefix(f'{sums_file}: ')})") from None
    for name in sorted(sums):
        path = directory / name
        if Path(name).name != name:
            raise ChangedWeights(f"{what}: {sums_file} names {name!r}, not a file of the directory")
        try:
            got = file_crc32(path)
        except OSError as e:
            raise ChangedWeights(
                f"{what}: {path} is gone or unreadable after the trainer wrote it ({e.strerror})"
            ) from None
        if got != sums[name]:
            raise ChangedWeights(
                f"{what}: {path}: its bytes changed after the trainer wrote it (CRC-32 {got}, written as {sums[name]})"
            )
