"""`read_safetensors`: a safetensors file read into fresh tensors, without the library's per-read leak.

safetensors 0.8's file readers (``load_file``, ``safe_open(...).get_tensor``/``get_slice``) keep about 64 bytes of
native memory per tensor read for the life of the process, after ``gc.collect()`` and ``malloc_trim(0)``
(``benchmarks/safetensors_read_mem.py``: 19.3 kB per read of a 300-tensor file). Inference reads a whole model at
every weight update, for days. safetensors' loader of bytes (``safetensors.torch.load``) keeps nothing (0.19 B a
tensor) and is faster, so the file is read whole and handed to it: the library still parses and checks the file
(a truncated or corrupt one is refused as there), at the cost of holding the file's bytes beside its tensors while
one file is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from prime_core.io import UnreadableFile, open_regular


def read_safetensors(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` on ``device``, as ``safetensors.torch.load_file`` gives them.
    A file that is not one (truncated, header and data disagree) raises `UnreadableFile` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path, device = Path(path), torch.device(device)
    with open_regular(path) as f:
        data = f.read()
    try:
        state = load(data)
    except SafetensorError as e:
        raise UnreadableFile(f"{path}: unreadable safetensors ({e})") from None
    del data
    return state if device.type == "cpu" else {name: t.to(device) for name, t in state.items()}
