"""`read_safetensors`: a safetensors file read into fresh tensors, without the library's per-read leak.

safetensors 0.8's file readers (``load_file``, ``safe_open(...).get_tensor``/``get_slice``) keep about 64 bytes of
native memory per tensor read for the life of the process, after ``gc.collect()`` and ``malloc_trim(0)``
(``benchmarks/safetensors_read_mem.py``: 19.3 kB per read of a 300-tensor file). Inference reads a whole model at
every weight update, for days. This reader follows the format safetensors documents (an 8-byte little-endian header
length, a JSON header of dtype, shape and data offsets, then the data) and reads the data in one ``readinto`` into one
tensor, of which each tensor is a view: flat, no mmap, one copy, and faster than the library's readers. It checks what the
library's reader checks, so a truncated or corrupt file is refused as there.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from prime_core.io import UnreadableFile, open_regular

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own bound on a header: a file claiming more is not one (and would be read whole into memory)."""

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors dtype names -> torch dtypes (bfloat16 has no numpy dtype: the bytes go straight into the tensor)."""


def read_safetensors(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` on ``device``, exactly as ``safetensors.torch.load_file`` gives
    them: views of one buffer of the file's data (keeping one tensor keeps the buffer, as with the library's
    mapping; the callers copy the tensors into a model and drop the dict). A file that is not one (truncated, header and data disagree) raises `UnreadableFile` naming it."""
    path, device = Path(path), torch.device(device)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        entries = _entries(f, size, path)
        data = torch.empty(size - f.tell(), dtype=torch.uint8)
        if f.readinto(data.numpy()) != data.numel():
            raise UnreadableFile(f"{path}: unreadable safetensors (cut short while read)")
    data = data.to(device)
    state = {}
    for name, dtype, shape, begin, end in entries:
        # Views of one buffer, as the library's tensors are views of one mapping: one read and no copy per tensor.
        # A tensor at an offset its dtype cannot start at (a writer that does not align) gets a copy of its own.
        raw = data[begin:end] if begin % dtype.itemsize == 0 else data[begin:end].clone()
        state[name] = raw.view(dtype).reshape(shape)
    return state


def _entries(f, size: int, path: Path) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor in the order of its data, after the checks safetensors makes: the header is
    a JSON object within the file, each dtype known, each tensor's bytes its shape's, the data contiguous and exactly
    the rest of the file. ``f`` is left at the first byte of the data."""

    def bad(why: str) -> UnreadableFile:
        return UnreadableFile(f"{path}: unreadable safetensors ({why})")

    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise bad(f"header length {n} in a file of {size} bytes")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ is not an object of strings")
    entries, offset = [], 0
    for begin, end, name, e in sorted((*_offsets(e), name, e) for name, e in header.items()):
        if not isinstance(e, dict):
            raise bad(f"{name}: its entry is not a JSON object")
        dtype, shape = DTYPES.get(e.get("dtype")), e.get("shape")
        if dtype is None or type(shape) is not list or not all([type(d) is int and d >= 0 for d in shape]):
            raise bad(f"{name}: dtype {e.get('dtype')!r} or shape {shape!r} is not one")
        if begin != offset or end - begin != math.prod(shape) * dtype.itemsize:
            raise bad(f"{name}: data offsets {e.get('data_offsets')} do not follow at {offset} with its size")
        entries.append((name, dtype, shape, begin, end))
        offset = end
    if 8 + n + offset != size:
        raise bad(f"the header describes {offset} bytes of data, the file holds {size - 8 - n}")
    return entries


def _offsets(entry: object) -> tuple[int, int]:
    """An entry's ``data_offsets``; (-1, -1) where it has none, which the offset check then refuses."""
    offsets = entry.get("data_offsets") if type(entry) is dict else None
    if type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int:
        return offsets[0], offsets[1]
    return -1, -1
