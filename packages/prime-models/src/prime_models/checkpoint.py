"""Export to Hugging Face format: a streaming HF state dict and an atomic, sharded `save_hf`."""

from __future__ import annotations

import copy
import json
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from prime_core.io import file_crc32
from safetensors.torch import save_file

from prime_models.loading import INDEX_FILE
from prime_models.registry import spec_for_model

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if m is None or (m.group(2) or "b").lower() not in _UNITS:
        raise ValueError(f"cannot parse size {size!r}; use bytes or e.g. '5GB', '500MiB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def hf_state_dict(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    lora_adapter: str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the full HF-format state dict one tensor at a time.

    FSDP2-sharded (DTensor) parameters are gathered with `full_tensor()`, a collective: every rank must consume the
    iterator in the same order, even though usually only rank 0 uses the tensors. LoRA adapter tensors are never
    part of it: with ``lora_adapter`` the adapted weights are merged (W + alpha/r * B @ A, in fp32), else they are
    the frozen base weights (export adapters with `prime_models.lora.save_adapter`).
    """
    from torch.distributed.tensor import DTensor  # heavy import (sympy); only needed when exporting

    from prime_models import lora

    spec = spec_for_model(model)
    layers = lora.lora_layers(model)
    merged = lora.selection(model).merged if layers else None
    if lora_adapter is not None and lora_adapter not in lora.adapter_names(model):
        raise KeyError(f"no LoRA adapter {lora_adapter!r}")
    if merged is not None and lora_adapter not in (None, merged):
        raise ValueError(f"adapter {merged!r} is merged into the weights; unmerge it to export {lora_adapter!r}")
    for name, tensor in model.state_dict().items():
        if lora.is_adapter_param(name):
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        layer = layers.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if lora_adapter is not None and merged is None and layer is not None and lora_adapter in layer.lora_A:
            tensor = (tensor.float() + layer.delta_weight(lora_adapter).to(tensor.device)).to(tensor.dtype)
        if dtype is not None:
            tensor = tensor.to(dtype)
        tensor = tensor.to(device)
        yield from spec.to_hf(name, tensor, model.args)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_hf(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    lora_adapter: str | None = None,
) -> dict[str, str]:
    """Write an HF directory that `transformers.AutoModelForCausalLM.from_pretrained` opens unchanged.

    Writes `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards), `model.safetensors.index.json`,
    `config.json` and `generation_config.json`. Every file is written under a temporary name and renamed into place.
    Under torch.distributed every rank must call this (parameters are gathered collectively); only rank 0 writes.
    ``lora_adapter`` merges that LoRA adapter into the saved weights (see `hf_state_dict`).
    Returns the CRC-32 of each safetensors file by name (rank 0; `prime_core.schemas.weights.CHECKSUMS_FILE`),
    summed from the tensors in memory, not read back.
    """
    distributed = dist.is_available() and dist.is_initialized()
    is_writer = not distributed or dist.get_rank() == 0
    max_bytes = parse_size(max_shard_size)
    out = Path(path)
    if is_writer:
        out.mkdir(parents=True, exist_ok=True)

    shards: list[Path] = []
    shard_keys: list[list[str]] = []
    shard_sums: list[str] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total_bytes = 0
    saved_dtype = dtype

    def flush():
        nonlocal current, current_bytes
        tmp = out / f".shard-{len(shards):05d}.safetensors.tmp"
        save_file(current, str(tmp), metadata={"format": "pt"})
        shard_sums.append(_written_crc32(tmp, current))
        shards.append(tmp)
        shard_keys.append(list(current))
        current, current_bytes = {}, 0

    for name, tensor in hf_state_dict(model, dtype=dtype, lora_adapter=lora_adapter):
        if not is_writer:
            continue
        saved_dtype = saved_dtype or tensor.dtype
        nbytes = tensor.numel() * tensor.element_size()
        if current and current_bytes + nbytes > max_bytes:
            flush()
        # safetensors refuses tensors sharing storage (e.g. tied or split views), so store independent copies.
        current[name] = tensor.contiguous().clone() if tensor.untyped_storage().nbytes() != nbytes else tensor
        current_bytes += nbytes
        total_bytes += nbytes

    if is_writer:
        if current or not shards:
            flush()
        names = _place_shards(out, shards, shard_keys, total_bytes)
        _write_configs(model, out, saved_dtype)
    if distributed:
        dist.barrier()
    return dict(zip(names, shard_sums, strict=True)) if is_writer else {}


def _written_crc32(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The CRC-32 of the safetensors file just written from ``tensors``, from its header (read back: a few KiB) and
    the tensors' bytes in memory, in the order of the file's data section. It costs a CRC pass over memory (about
    0.15-0.3 s per GiB), not a read of the file; a layout this does not follow (padding between tensors) reads the
    file back instead."""
    with open(path, "rb") as f:
        head = f.read(8)
        header = head + f.read(int.from_bytes(head, "little"))
    entries = json.loads(header[8:])
    entries.pop("__metadata__", None)
    crc, offset = zlib.crc32(header), 0
    for name, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"]):
        tensor = tensors[name]
        begin, end = entry["data_offsets"]
        if begin != offset or tensor.device.type != "cpu" or end - begin != tensor.numel() * tensor.element_size():
            return file_crc32(path)
        if end > begin:
            crc = zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
        offset = end
    return f"{crc:08x}" if len(header) + offset == path.stat().st_size else file_crc32(path)


def _place_shards(out: Path, shards: list[Path], shard_keys: list[list[str]], total_bytes: int) -> list[str]:
    """Rename the written shards to their HF names, drop stale shards of an earlier save, write the index."""
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for tmp, final, keys in zip(shards, names, shard_keys, strict=True):
        os.replace(tmp, out / final)
        weight_map.update(dict.fromkeys(keys, final))
    for stale in out.glob("model*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic_write_text(out / INDEX_FILE, json.dumps(index, indent=2))
    return names


def _write_configs(model: torch.nn.Module, out: Path, dtype: torch.dtype | None) -> None:
    spec = spec_for_model(model)
    config = copy.deepcopy(model.config)
    config.architectures = [spec.hf_architecture]
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    _atomic_write_text(out / "config.json", config.to_json_string())
    gen = getattr(model, "generation_config_dict", None)
    if gen is None:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_model_config(config).to_dict()
    _atomic_write_text(out / "generation_config.json", json.dumps(gen, indent=2) + "\n")
