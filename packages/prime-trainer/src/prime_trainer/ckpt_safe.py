"""Reading a checkpoint someone else may have written, without running any code it carries.

A checkpoint is copied between users and clusters, and ``--resume`` must not be a way to run code on the host. Three
of its files are pickles: DCP's ``.metadata``, the optimizer's scalars (``param_groups``) that DCP keeps as byte items
inside the ``.distcp`` shards, and ``rng/rank_R.pt``. Stock DCP unpickles the first two with ``pickle.load`` and
``torch.load(weights_only=False)``, and the trainer once read the third the same way: each ran whatever its author
put in. Here ``.metadata`` goes through an unpickler that builds DCP's own index classes and nothing else, and the
byte items and the RNG state through ``torch.load(weights_only=True)``, which builds tensors and plain containers only.
A file that asks for anything else fails to load, and ``CheckpointManager`` turns that into one line naming it.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from prime_core.io import open_regular
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

RNG_MAX_BYTES = 1 << 20
"""An RNG state file is about 15 KB (torch's 5 KB, Python's and NumPy's 625 words each, CUDA's few bytes); a larger one
is not one, and is refused before it is read rather than loaded into memory whole."""

# What a ``.metadata`` written by torch 2.x refers to: DCP's index dataclasses, the tensor shape and dtype, the path of
# the checkpoint as it was saved. Each is plain data built from plain data.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[(module, name)]
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint index never holds (not loaded)")


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` unpickled through the allowlist above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        # Only a regular file: a FIFO under the index's name blocked every rank in open for good.
        with open_regular(path) as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with byte items (the optimizer's hyperparameters) read by ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def rng_state() -> dict[str, Any]:
    """This process's RNG state as tensors and plain values only, so that ``weights_only=True`` reads it back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Checkpoints saved before the state was stored as tensors hold NumPy's key array as a pickled ndarray: its rebuild
# function (under the name of the NumPy that saved it) and dtype are allowed, nothing more.
_OLD_RNG_GLOBALS = [
    np._core.multiarray._reconstruct,
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


def load_rng_state(path: Any) -> dict[str, Any]:
    """Read ``rng/rank_R.pt`` without running code from it (``weights_only=True``), bounded in size."""
    size = path.stat().st_size
    if size > RNG_MAX_BYTES:
        raise ValueError(f"{size} bytes, an RNG state is under {RNG_MAX_BYTES} (not loaded)")
    with torch.serialization.safe_globals(_OLD_RNG_GLOBALS):
        state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or not {"torch", "python", "numpy"} <= state.keys():
        raise ValueError("not an RNG state (wants the keys torch, python, numpy)")
    return state
