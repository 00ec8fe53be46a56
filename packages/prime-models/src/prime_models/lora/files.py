"""LoRA adapters as PEFT directories (``adapter_config.json`` + ``adapter_model.safetensors``), and adapters moved
between models by their PEFT-keyed tensors."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from prime_core.io import read_json
from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from torch import nn

from prime_models.lora.adapters import (
    LoRASpec,
    _full,
    _wrap_targets,
    check_adapter_name,
    lora_layers,
    remove_adapter,
    selection,
)

PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def adapter_state_dict(
    model: nn.Module, name: str, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT key, tensor on ``device``, default the CPU) for adapter ``name``. Collective under FSDP: every rank
    must consume it."""
    if name not in selection(model).specs:
        raise KeyError(f"no adapter {name!r}")
    for module_name, layer in lora_layers(model).items():
        if name not in layer.lora_A:
            continue
        for ab, linear in (("A", layer.lora_A[name]), ("B", layer.lora_B[name])):
            t = _full(linear.weight).detach()
            if dtype is not None:
                t = t.to(dtype)
            yield f"{PEFT_PREFIX}{module_name}.lora_{ab}.weight", t.to(device or "cpu").contiguous()


def save_adapter(
    model: nn.Module,
    name: str,
    path: str | os.PathLike,
    *,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write adapter ``name`` as a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Files are written under temporary names and renamed into place. Under torch.distributed every rank must call it
    (FSDP shards are gathered collectively); rank 0 writes.
    """
    from safetensors.torch import save_file

    distributed = dist.is_available() and dist.is_initialized()
    is_writer = not distributed or dist.get_rank() == 0
    tensors = dict(adapter_state_dict(model, name, dtype=dtype))
    if is_writer:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / ADAPTER_WEIGHTS)
        cfg_tmp = out / f".{ADAPTER_CONFIG}.tmp"
        cfg_tmp.write_text(json.dumps(selection(model).specs[name].peft_config(base_model), indent=2) + "\n")
        os.replace(cfg_tmp, out / ADAPTER_CONFIG)
    if distributed:
        dist.barrier()


def read_adapter(path: str | os.PathLike) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """Spec and {module name: (A, B)}-ready tensors (PEFT keys) of a PEFT LoRA directory (read by `read_safetensors`:
    an adapter is read at every step of a LoRA run, and safetensors' own reader keeps memory at each read)."""
    from prime_models.tensor_files import read_safetensors

    p = Path(path)
    if not is_adapter_dir(p):
        raise ValueError(f"{p} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    spec = LoRASpec.from_peft_config(read_json(p / ADAPTER_CONFIG, "an adapter config"))
    return spec, read_safetensors(p / ADAPTER_WEIGHTS)


def load_adapter(model: nn.Module, name: str, path: str | os.PathLike, *, replace: bool = True) -> LoRASpec:
    """Load a PEFT LoRA directory as adapter ``name`` (replacing an existing one of that name when ``replace``).

    Layers the adapter names are wrapped on demand, so a plain (never LoRA'd) model serves it. The loaded adapter is
    frozen (serving). Raises ValueError when the files do not fit the model.
    """
    spec, tensors = read_adapter(path)
    return install_adapter(model, name, spec, tensors, replace=replace, source=str(path))


def copy_adapters(src: nn.Module, dst: nn.Module) -> None:
    """Install every adapter of ``src`` on ``dst`` (e.g. a freshly loaded base that replaces ``src``)."""
    for name, spec in selection(src).specs.items():
        install_adapter(dst, name, spec, dict(adapter_state_dict(src, name)))


@torch.no_grad()
def install_adapter(
    model: nn.Module,
    name: str,
    spec: LoRASpec,
    tensors: dict[str, torch.Tensor],
    *,
    replace: bool = True,
    source: str = "adapter",
) -> LoRASpec:
    """Install adapter ``name`` from PEFT-keyed tensors (see `adapter_state_dict`); frozen, as for serving."""
    check_adapter_name(name)
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise ValueError(f"unexpected tensor {key!r} in {source} (expected {PEFT_PREFIX}<module>.lora_A/B.weight)")
        weights.setdefault(m.group("module"), {})[m.group("ab")] = t
    if not weights:
        raise ValueError(f"{source} holds no LoRA tensors")
    sel = selection(model)
    if sel.merged is not None:
        raise ValueError(f"adapter {sel.merged!r} is merged; unmerge it before loading adapters")
    modules = dict(model.named_modules())
    for module, ab in weights.items():
        target = modules.get(module)
        if not isinstance(target, nn.Linear) or set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {source}: {module!r} is not a linear layer of this model (or lacks A or B)")
        a, b = ab["A"], ab["B"]
        if a.shape != (spec.rank, target.in_features) or b.shape != (target.out_features, spec.rank):
            raise ValueError(
                f"adapter {source}: {module} has A {tuple(a.shape)} / B {tuple(b.shape)}, the model expects "
                f"A ({spec.rank}, {target.in_features}) / B ({target.out_features}, {spec.rank})"
            )
        # A downloaded adapter with one NaN serves NaN logits under its name, every request sampling token 0.
        for ab_name, t in (("A", a), ("B", b)):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"adapter {source}: {module} lora_{ab_name} holds NaN or infinite values")
    targets = {m.rpartition(".")[2] for m in weights}
    spec = LoRASpec(spec.rank, spec.alpha, spec.dropout, tuple(sorted(targets)))
    if name in sel.specs:
        if not replace:
            raise ValueError(f"adapter {name!r} already exists")
        remove_adapter(model, name)
    _wrap_targets(model, targets)
    layers = lora_layers(model)
    for module, ab in weights.items():
        layer = layers[module]
        layer.add_adapter(name, spec)
        layer.lora_A[name].weight.copy_(ab["A"])
        layer.lora_B[name].weight.copy_(ab["B"])
        layer.lora_A[name].weight.requires_grad_(False)
        layer.lora_B[name].weight.requires_grad_(False)
    sel.specs[name] = spec
    return spec
