"""The micro-batch file: what the orchestrator hands one trainer rank for one step.

One file per trainer rank per step (``rollouts/step_N/rank_R.safetensors``), written atomically. The
payload is a safetensors file (numpy arrays, readable zero-copy by ``safetensors.torch``) whose
``__metadata__`` carries a JSON ``RolloutBatchMeta`` under the key ``prime``.

A micro-batch is ``[rows, seq_len]`` packed rows. Conventions, per row position ``t``:

- ``input_ids[t]``: the token at ``t``. ``position_ids[t]`` restarts at 0 at every sample start, so
  sample boundaries are where ``position_ids`` drops to 0 (padding continues counting from 0 too and has
  ``sample_ids == -1``).
- ``loss_mask[t]``: 1 when token ``t`` was sampled by the policy and is trained on (completion tokens);
  its log-prob is predicted from position ``t - 1`` of the same sample, so a sample's first token never
  has ``loss_mask == 1``.
- ``advantages[t]``: the advantage of the sample owning ``t`` (0 where ``loss_mask == 0``).
- ``inference_logprobs[t]``: the log-prob the inference engine assigned to token ``t`` when sampling it
  (0 where ``loss_mask == 0``).
- ``sample_ids[t]``: the sample's index in the step (``-1`` on padding), for sequence-level losses.

Vision-language micro-batches add three optional arrays (absent for text-only batches, and in files written before
they existed):

- ``pixel_values`` ``[num_patches, patch_dim]`` float32: the patches of every image of the micro-batch, concatenated
  in the order the images' placeholder runs appear in ``input_ids`` (row-major). See ``prime_core.vision``.
- ``image_grid_thw`` ``[num_images, 3]`` int64: each image's (temporal, height, width) patch grid.
- ``mrope_position_ids`` ``[3, rows, seq_len]`` int64: 3D rotary positions (``prime_core.vision.mrope_positions``),
  restarting at 0 at every sample start like ``position_ids``; text tokens carry equal values on all three axes.

``extra`` holds further per-token arrays ``[rows, seq_len]`` (integer or floating point, 0 where no sample put a
value), stored as ``{index}.extra.{name}``. They reach the loss unchanged, as ``LossInputs.extra[name]`` on the
training device: a loss that needs a new per-token input (a teacher's log-probs, a per-token reward) reads it there,
and whoever packs the micro-batch fills it (the orchestrator from ``Sample.extra``); nothing in between names it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from dataclasses import dataclass, field, replace

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prime_core.io import UnreadableFile, atomic_path, open_regular, reading

MICROBATCH_SCHEMA_VERSION = 1
EXTRA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

# Optional vision-language arrays: name -> dtype (shapes in the module docstring).
MULTIMODAL_FIELDS: dict[str, np.dtype] = {
    "pixel_values": np.dtype(np.float32),
    "image_grid_thw": np.dtype(np.int64),
    "mrope_position_ids": np.dtype(np.int64),
}

# name -> dtype; the order is the on-disk order.
MICROBATCH_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64),
    "position_ids": np.dtype(np.int64),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "inference_logprobs": np.dtype(np.float32),
    "sample_ids": np.dtype(np.int64),
}


class RolloutBatchMeta(BaseModel):
    """Header of a micro-batch file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    schema_version: int = MICROBATCH_SCHEMA_VERSION
    """Version of this file format; readers refuse versions they do not know."""
    step: int = Field(ge=0)
    """Training step these rollouts are for."""
    rank: int = Field(ge=0)
    """Trainer rank this file is for."""
    num_micro_batches: int = Field(ge=0)
    """Number of micro-batches in the file (equal across ranks of one step)."""
    seq_len: int = Field(ge=1)
    """Row length in tokens."""
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Sampling temperature used by inference; the trainer scales its logits by it (0 would make them infinite, a
    negative one would train toward the tokens the policy least prefers)."""
    global_loss_tokens: int = 0
    """Number of loss tokens in this step over all ranks (for global token-count normalization)."""
    global_num_samples: int = 0
    """Number of samples in this step over all ranks (for per-sequence normalization)."""
    weight_steps: list[int] = Field(default_factory=list)
    """Weight step that generated each sample of this file, by local sample index (off-policy lag)."""
    extras: dict[str, float | int | str] = Field(default_factory=dict)
    """Free-form scalar annotations (e.g. environment mix); ignored by the trainer."""
    run_id: str | None = None
    """``PRIME_RUN_ID`` of the launch whose orchestrator wrote the file (None without one): the trainer refuses a file
    of another launch at its path (two runs sharing an output directory, a file an earlier launch left)."""


@dataclass
class MicroBatch:
    """``[rows, seq_len]`` arrays of one micro-batch (see the module docstring for their meaning)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    sample_ids: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    """Further per-token arrays ``[rows, seq_len]`` by name, handed to the loss as they are (module docstring)."""
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    mrope_position_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        shape = None
        for name, dtype in MICROBATCH_FIELDS.items():
            arr = np.ascontiguousarray(np.asarray(getattr(self, name)), dtype=dtype)
            if arr.ndim == 1:
                arr = arr[None, :]
            if arr.ndim != 2:
                raise ValueError(f"micro-batch field {name!r} must be [rows, seq_len], got shape {arr.shape}")
            if shape is None:
                shape = arr.shape
            elif arr.shape != shape:
                raise ValueError(f"micro-batch field {name!r} has shape {arr.shape}, expected {shape}")
            setattr(self, name, arr)
        self.extra = {name: _extra_array(name, arr, shape) for name, arr in self.extra.items()}
        for name, dtype in MULTIMODAL_FIELDS.items():
            if getattr(self, name) is not None:
                setattr(self, name, np.ascontiguousarray(np.asarray(getattr(self, name)), dtype=dtype))
        if (self.pixel_values is None) != (self.image_grid_thw is None):
            raise ValueError("micro-batch pixel_values and image_grid_thw must be given together")
        if self.image_grid_thw is not None:
            self.image_grid_thw = self.image_grid_thw.reshape(-1, 3)
            if int(self.image_grid_thw.prod(-1).sum()) != self.pixel_values.shape[0]:
                raise ValueError(
                    f"micro-batch image_grid_thw covers {int(self.image_grid_thw.prod(-1).sum())} patches, "
                    f"pixel_values has {self.pixel_values.shape[0]}"
                )
        if self.mrope_position_ids is not None and self.mrope_position_ids.shape != (3, *shape):
            raise ValueError(
                f"micro-batch mrope_position_ids has shape {self.mrope_position_ids.shape}, expected {(3, *shape)}"
            )

    @property
    def is_multimodal(self) -> bool:
        return self.pixel_values is not None or self.mrope_position_ids is not None

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_ids.shape  # type: ignore[return-value]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def extra_dtypes(self) -> dict[str, np.dtype]:
        return {name: arr.dtype for name, arr in self.extra.items()}

    def without_empty_rows(self) -> MicroBatch:
        """This micro-batch without its all-padding rows (no token of a sample, no loss token), keeping at least one.

        Packing fills the last micro-batch of a step (and every micro-batch a rank pads with) with such rows; a
        forward over them is compute for nothing: 7 of the one-GPU loop's 64 rows a step (docs/benchmarks.md)."""
        # A loss token on a padding id (a malformed file) keeps its row: it trained before and must not vanish silently.
        keep = (self.sample_ids >= 0).any(axis=1) | self.loss_mask.any(axis=1)
        if keep.all():
            return self
        keep[0] = keep[0] or not keep.any()
        rows = np.flatnonzero(keep)
        mrope = None if self.mrope_position_ids is None else self.mrope_position_ids[:, rows]
        return replace(
            self,
            **{name: getattr(self, name)[rows] for name in MICROBATCH_FIELDS},
            extra={name: arr[rows] for name, arr in self.extra.items()},
            mrope_position_ids=mrope,
        )

    @classmethod
    def empty(cls, rows: int, seq_len: int, extra: dict[str, np.dtype] | None = None) -> MicroBatch:
        """An all-padding micro-batch (used to keep ranks in lockstep when one has less data), with zero ``extra``
        arrays of these names and dtypes (the other micro-batches' `extra_dtypes`)."""
        zeros = {n: np.zeros((rows, seq_len), dtype=d) for n, d in MICROBATCH_FIELDS.items()}
        zeros["sample_ids"][:] = -1
        zeros["position_ids"][:] = np.arange(seq_len)
        return cls(**zeros, extra={n: np.zeros((rows, seq_len), dtype=d) for n, d in (extra or {}).items()})


def _extra_array(name: str, value: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name):
        raise ValueError(f"micro-batch extra name {name!r} must match {EXTRA_NAME.pattern}")
    arr = np.ascontiguousarray(np.asarray(value))
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"micro-batch extra {name!r} must hold integers or floats, got {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.shape != shape:
        raise ValueError(f"micro-batch extra {name!r} has shape {arr.shape}, expected {shape} (one value per token)")
    return arr


def stack_rows(rows: list[MicroBatch]) -> MicroBatch:
    """Concatenate micro-batches along rows; images keep their row-major order. Rows without 3D positions get their
    ``position_ids`` on all three axes when another row has them."""
    stacked = {f: np.concatenate([getattr(r, f) for r in rows]) for f in MICROBATCH_FIELDS}
    dtypes: dict[str, list[np.dtype]] = {}
    for r in rows:
        for name, dtype in r.extra_dtypes.items():
            dtypes.setdefault(name, []).append(dtype)
    # A row without an array (padding, a sample that had none) holds zeros there.
    extra = {
        name: np.concatenate([r.extra.get(name, np.zeros(r.shape, np.result_type(*ds))) for r in rows])
        for name, ds in dtypes.items()
    }
    images = [r for r in rows if r.pixel_values is not None]
    if images:
        stacked["pixel_values"] = np.concatenate([r.pixel_values for r in images])
        stacked["image_grid_thw"] = np.concatenate([r.image_grid_thw for r in images])
    if any(r.mrope_position_ids is not None for r in rows):
        stacked["mrope_position_ids"] = np.concatenate(
            [
                r.mrope_position_ids
                if r.mrope_position_ids is not None
                else np.broadcast_to(r.position_ids, (3, *r.shape))
                for r in rows
            ],
            axis=1,
        )
    return MicroBatch(**stacked, extra=extra)


def microbatch_tensors(index: int, mb: MicroBatch) -> dict[str, np.ndarray]:
    """The arrays of micro-batch ``index`` under their on-disk names (``{index}.{field}``)."""
    tensors: dict[str, np.ndarray] = {}
    for name in MICROBATCH_FIELDS:
        arr = getattr(mb, name)
        # safetensors has no bool in its numpy bridge on all versions; store masks as uint8.
        tensors[f"{index}.{name}"] = arr.astype(np.uint8) if arr.dtype == np.bool_ else arr
    for name in MULTIMODAL_FIELDS:
        if getattr(mb, name) is not None:
            tensors[f"{index}.{name}"] = getattr(mb, name)
    for name, arr in mb.extra.items():
        tensors[f"{index}.extra.{name}"] = np.ascontiguousarray(arr)
    return tensors


def microbatches_from_tensors(count: int, tensors: dict[str, np.ndarray]) -> list[MicroBatch]:
    """The ``count`` micro-batches of a file's tensors. A tensor no micro-batch reads (a micro-batch past ``count``, a
    field this reader does not know) is refused: it would be dropped silently, and with it rows of the step."""
    known = set(MICROBATCH_FIELDS) | set(MULTIMODAL_FIELDS)
    for key in sorted(tensors):
        index, _, name = key.partition(".")
        if not (index.isdigit() and int(index) < count and (name in known or name.startswith("extra."))):
            raise ValueError(
                f"tensor {key!r} is not a field of micro-batches 0..{count - 1} (meta num_micro_batches = {count})"
            )
    return [microbatch_from_tensors(i, tensors) for i in range(count)]


def microbatch_from_tensors(index: int, tensors: dict[str, np.ndarray]) -> MicroBatch:
    """Inverse of ``microbatch_tensors``. Each field must have the dtype it is written with: `MicroBatch` would cast
    any other, so token ids stored as floats (1.7) or log-probs as integers would train silently as something else."""
    for name, dtype in {**MICROBATCH_FIELDS, **MULTIMODAL_FIELDS}.items():
        stored = np.dtype(np.uint8) if dtype == np.bool_ else dtype
        arr = tensors.get(f"{index}.{name}")
        if arr is not None and arr.dtype != stored:
            raise ValueError(f"micro-batch {index} field {name!r} is {arr.dtype}, written as {stored}")
    fields = {name: tensors[f"{index}.{name}"] for name in MICROBATCH_FIELDS}
    optional = {name: tensors.get(f"{index}.{name}") for name in MULTIMODAL_FIELDS}
    prefix = f"{index}.extra."
    extra = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    return MicroBatch(**fields, **optional, extra=extra)


# An inference log-prob above this (a probability past e^0.5) is not one: negated log-probs, probabilities, another
# array. An engine rounds a near-certain token's log-prob to a hair above 0, never this far.
MAX_INFERENCE_LOGPROB = 0.5


def check_microbatch(mb: MicroBatch, seq_len: int, vocab_size: int | None = None) -> str | None:
    """Why ``mb`` (of a file whose rows are ``seq_len`` long) cannot be trained on, naming the field and position, or
    None. Each of these trained without an error before, on garbage, or crashed inside the forward (a token id past the
    embedding is an IndexError on the CPU and a device-side assert that takes the CUDA context down on a GPU). Values
    that are not finite are `nonfinite_fields`: the step they reach is skipped, not the run stopped."""
    rows, width = mb.shape
    if rows == 0:
        return "holds no rows"
    if width != seq_len:
        return f"rows are {width} tokens long, the file's seq_len is {seq_len}"
    ids = mb.input_ids
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        return (
            f"holds token id {bad}, outside the model's vocabulary of {vocab_size} (rollouts of another model or "
            "tokenizer?)"
        )
    if mb.image_grid_thw is not None and (mb.image_grid_thw < 1).any():
        i = int(np.argwhere(mb.image_grid_thw < 1)[0][0])
        return f"image_grid_thw[{i}] is {mb.image_grid_thw[i].tolist()} (an image's t, h, w patch counts are >= 1)"
    if mb.mrope_position_ids is not None and (mb.mrope_position_ids < 0).any():
        return "mrope_position_ids holds a negative position"
    pos, sid = mb.position_ids, mb.sample_ids
    if (pos < 0).any():
        r, t = np.argwhere(pos < 0)[0]
        return f"position_ids[{r}, {t}] is {pos[r, t]} (a position is >= 0)"
    # A sample's positions count 0, 1, ... from its first token (where its sample id starts): the rows' packing (which
    # tokens attend to which) and RoPE come from them, so other positions mix samples or rotate tokens wrongly.
    start = np.ones_like(sid, dtype=np.bool_)
    start[:, 1:] = sid[:, 1:] != sid[:, :-1]
    expected = np.zeros_like(pos)
    expected[:, 1:] = pos[:, :-1] + 1
    expected[start] = 0
    wrong = (sid >= 0) & (pos != expected)
    if wrong.any():
        r, t = np.argwhere(wrong)[0]
        return (
            f"position_ids[{r}, {t}] is {pos[r, t]}, expected {expected[r, t]} (sample {sid[r, t]}: positions count "
            "0, 1, ... from the sample's first token)"
        )
    for name, bad, why in (
        ("sample_ids", mb.loss_mask & (sid < 0), "is -1 (padding) on a loss token"),
        ("loss_mask", mb.loss_mask & start, "is set on a sample's first token, which no earlier token predicts"),
        (
            "inference_logprobs",
            mb.loss_mask & (mb.inference_logprobs > MAX_INFERENCE_LOGPROB),
            "is above 0 (a log-prob)",
        ),
    ):
        if bad.any():
            r, t = np.argwhere(bad)[0]
            return f"{name}[{r}, {t}] {why}" + (f": {getattr(mb, name)[r, t]}" if name == "inference_logprobs" else "")
    return None


def nonfinite_fields(mb: MicroBatch) -> dict[str, int]:
    """Floating point fields of ``mb`` with NaN or infinite values on loss tokens (any of ``pixel_values``): field ->
    how many."""
    arrays = {"advantages": mb.advantages, "inference_logprobs": mb.inference_logprobs}
    arrays.update({f"extra.{n}": a for n, a in mb.extra.items() if a.dtype.kind == "f"})
    counts = {name: int((~np.isfinite(a[mb.loss_mask])).sum()) for name, a in arrays.items()}
    if mb.pixel_values is not None:
        counts["pixel_values"] = int((~np.isfinite(mb.pixel_values)).sum())
    return {name: n for name, n in counts.items() if n}


def tensors_crc32(tensors: dict[str, np.ndarray]) -> str:
    """CRC-32 of every tensor's name, dtype, shape and bytes, in name order: a micro-batch file carries it
    (``prime_crc32``) so that bytes changed after the write (a disk, a copy, a stray writer) are refused, not trained:
    a flipped advantage or log-prob is a valid float and passes every other check."""
    crc = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        crc = zlib.crc32(f"{name}:{arr.dtype.str}:{arr.shape}".encode(), crc)
        crc = zlib.crc32(arr.data.cast("B") if arr.size else b"", crc)
    return f"{crc:08x}"


def microbatch_file_metadata(meta: RolloutBatchMeta, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """The safetensors metadata of a micro-batch file (its header; ``tensors_crc32`` of its data)."""
    return {"prime": meta.model_dump_json(), "prime_crc32": tensors_crc32(tensors)}


def write_microbatches(path: str | os.PathLike, meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> None:
    """Write one rank's micro-batches for one step, atomically."""
    from safetensors.numpy import save_file

    if meta.num_micro_batches != len(micro_batches):
        raise ValueError(f"meta says {meta.num_micro_batches} micro-batches, got {len(micro_batches)}")
    tensors: dict[str, np.ndarray] = {}
    for i, mb in enumerate(micro_batches):
        tensors.update(microbatch_tensors(i, mb))
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=microbatch_file_metadata(meta, tensors))


def decode_microbatches(payload: bytes) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
    """The bytes of a micro-batch file (``write_microbatches``; the zmq transport sends the same bytes)."""
    from safetensors.numpy import load

    tensors = load(payload)  # checks the header against the data first: a header that lies is its error
    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    raw = (header.get("__metadata__") or {}).get("prime")
    if raw is None:
        raise UnreadableFile("not a prime micro-batch file (no 'prime' metadata)")
    crc = (header.get("__metadata__") or {}).get("prime_crc32")  # absent in a file of an older writer
    if crc is not None and crc != (got := tensors_crc32(tensors)):
        raise UnreadableFile(
            f"its data changed after it was written (CRC-32 {got}, written as {crc}): a bad disk or copy"
        )
    data = json.loads(raw)
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != MICROBATCH_SCHEMA_VERSION:
        raise UnreadableFile(f"micro-batch schema version {version}, this reader knows {MICROBATCH_SCHEMA_VERSION}")
    try:
        meta = RolloutBatchMeta.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise UnreadableFile(f"meta field {where!r} is {error.get('input')!r}: {error['msg']}") from None
    return meta, microbatches_from_tensors(meta.num_micro_batches, tensors)


def read_microbatches(path: str | os.PathLike) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
    """Read a file written by ``write_microbatches`` (numpy arrays). Only a regular file is opened: a FIFO left at the
    path blocked the trainer in ``open`` for good, holding the GIL, so no watchdog thread of it ran either."""
    with reading(path, "micro-batch file"):
        try:
            with open_regular(path) as f:
                payload = f.read()
            return decode_microbatches(payload)
        except UnreadableFile as e:
            raise UnreadableFile(f"{path}: {e}") from None
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise UnreadableFile(f"{path}: not a regular file (a micro-batch file is one)") from None


def read_microbatch_meta(path: str | os.PathLike) -> RolloutBatchMeta:
    return read_microbatches(path)[0]
