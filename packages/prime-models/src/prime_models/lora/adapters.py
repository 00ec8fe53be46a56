"""LoRA: named low-rank adapters injected into a built model's linear layers, and their PEFT-format export.

`apply_lora` replaces each targeted `nn.Linear` (matched by its attribute name, e.g. ``q_proj``) with a `LoRALinear`
that keeps the base ``weight``/``bias`` under the same names (HF conversion, DCP checkpoints and FSDP wrapping see
the same parameters as before) and adds per-adapter ``lora_A.<adapter>`` / ``lora_B.<adapter>`` linear layers:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

A is Kaiming-uniform initialized and B zero, so a new adapter leaves the model's outputs unchanged. Every parameter
that is not an adapter is frozen. Apply it to a fully built (materialized) model before FSDP, as the parallelize
order in `prime_models.parallel` expects: FSDP then shards base and adapter parameters alike, and only the adapters
get gradients.

Several adapters may live on one base model (multi-tenant training, multi-adapter serving). Which one a forward uses
is a property of the model, not of the call: `set_active_adapter` picks one adapter for the whole batch (training),
`set_row_adapters` one per batch row (serving a mixed batch). An adapter that a layer does not have contributes zero
in that layer.

Export: `save_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names
(``base_model.model.<module>.lora_A.weight``), which vLLM's LoRA loader and ``peft.PeftModel.from_pretrained`` read;
`load_adapter` reads such a directory back. Merged full weights come from
``prime_models.save_hf(model, path, lora_adapter=name)``, or in place from `merge_adapter` / `unmerge_adapter`.

Shape legend: B batch rows, S sequence, I in features, O out features, R rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from prime_core.config.shared import LORA_TARGET_MODULES
from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_NAME_PATTERN, ADAPTER_WEIGHTS, is_adapter_dir
from torch import nn

DEFAULT_TARGET_MODULES = LORA_TARGET_MODULES
PEFT_PREFIX = "base_model.model."
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoRASpec:
    """Hyper-parameters of one adapter.

    Attributes:
        rank: r; A is [r, in], B is [out, r].
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the adapter input while training.
        target_modules: attribute names of the linear layers that get the adapter.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, config) -> LoRASpec:
        """From a `prime_core.config.shared.LoRAConfig` (or anything with the same attributes)."""
        return cls(config.rank, float(config.alpha), config.dropout, tuple(config.target_modules))

    def peft_config(self, base_model: str | None = None) -> dict:
        """The ``adapter_config.json`` PEFT writes for a LoRA adapter with these settings."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": None,
        }

    @classmethod
    def from_peft_config(cls, cfg: dict) -> LoRASpec:
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"adapter is {cfg.get('peft_type')!r}, not a LoRA adapter")
        for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
            if cfg.get(flag):
                raise ValueError(f"LoRA adapters with {flag}=true are not supported")
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise ValueError("LoRA adapters with per-module rank_pattern/alpha_pattern are not supported")
        if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
            raise ValueError("LoRA adapters that also train biases or modules_to_save are not supported")
        targets = cfg.get("target_modules")
        if isinstance(targets, str):
            raise ValueError(f"regex target_modules ({targets!r}) are not supported; list the module names")
        return cls(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout") or 0.0), tuple(targets))


@dataclass
class AdapterSelection:
    """Which adapter each forward uses; one object shared by every `LoRALinear` of a model.

    ``rows`` (one adapter name or None per batch row) wins over ``active`` (one adapter for the whole batch).
    None means the base model.
    """

    active: str | None = None
    rows: list[str | None] | None = None
    specs: dict[str, LoRASpec] = field(default_factory=dict)
    merged: str | None = None


class LoRALinear(nn.Linear):
    """An `nn.Linear` (same ``weight``/``bias`` parameters) plus named low-rank adapters."""

    def __init__(self, in_features: int, out_features: int, bias: bool, selection: AdapterSelection, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.selection = selection

    @classmethod
    def from_linear(cls, linear: nn.Linear, selection: AdapterSelection) -> LoRALinear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, selection)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def add_adapter(self, name: str, spec: LoRASpec, generator: torch.Generator | None = None) -> None:
        device, dtype = self.weight.device, self.weight.dtype
        a = nn.Linear(self.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        b = nn.Linear(spec.rank, self.out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            # PEFT's init: kaiming_uniform_(a=sqrt(5)) on A, i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0 (no-op adapter).
            bound = 1.0 / math.sqrt(self.in_features)
            if generator is None:
                a.weight.uniform_(-bound, bound)
            else:
                a.weight.copy_(
                    torch.rand(a.weight.shape, generator=generator, dtype=torch.float32, device=generator.device)
                    .mul_(2 * bound)
                    .sub_(bound)
                )
            b.weight.zero_()
        self.lora_A[name], self.lora_B[name] = a, b
        self.lora_dropout[name] = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling[name] = spec.scaling

    def remove_adapter(self, name: str) -> None:
        for d in (self.lora_A, self.lora_B, self.lora_dropout):
            if name in d:
                del d[name]
        self.scaling.pop(name, None)

    def delta_weight(self, name: str) -> torch.Tensor:
        """(alpha / r) * B @ A `[O, I]` in fp32 (gathering FSDP shards)."""
        a, b = _full(self.lora_A[name].weight).float(), _full(self.lora_B[name].weight).float()
        return (b @ a) * self.scaling[name]

    def _delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        sel = self.selection
        if sel.merged is not None:
            return y
        if sel.rows is not None:
            names = set(sel.rows)
            names.discard(None)
            for name in names:
                if name not in self.lora_A:
                    continue
                rows = [i for i, r in enumerate(sel.rows) if r == name]
                if len(rows) == x.shape[0]:
                    y = y + self._delta(name, x)
                else:
                    idx = torch.tensor(rows, device=x.device)
                    y = y.index_add(0, idx, self._delta(name, x.index_select(0, idx)))
            return y
        if sel.active is not None and sel.active in self.lora_A:
            y = y + self._delta(sel.active, x)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, adapters={sorted(self.lora_A)}"


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r}: use 1-128 letters, digits, '_', '-' or '.'")
    return name


def selection(model: nn.Module) -> AdapterSelection:
    """The model's adapter selection (created on first use)."""
    sel = getattr(model, "lora_selection", None)
    if sel is None:
        sel = AdapterSelection()
        model.lora_selection = sel
    return sel


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name -> `LoRALinear`, in `named_modules` order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_names(model: nn.Module) -> list[str]:
    return list(selection(model).specs)


def _wrap_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """Replace every `nn.Linear` whose attribute name is in ``targets`` with a `LoRALinear`; returns the names."""
    sel = selection(model)
    targets = set(targets)
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            wrapped.append(name)
            continue
        if not isinstance(module, nn.Linear) or name.rpartition(".")[2] not in targets or ".lora_" in name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear.from_linear(module, sel))
        wrapped.append(name)
    return wrapped


def add_adapter(model: nn.Module, name: str, spec: LoRASpec, *, seed: int | None = None) -> list[str]:
    """Add adapter ``name`` to every linear layer named in ``spec.target_modules``; returns the adapted modules.

    Layers are wrapped on first use. The new adapter is a no-op (B = 0) and trainable; ``seed`` makes A's init
    reproducible (and identical on every rank, as FSDP requires of unsharded init).
    """
    check_adapter_name(name)
    sel = selection(model)
    if name in sel.specs:
        raise ValueError(f"adapter {name!r} already exists")
    if sel.merged is not None:
        raise ValueError(f"adapter {sel.merged!r} is merged; unmerge it before adding adapters")
    _wrap_targets(model, spec.target_modules)
    adapted = [n for n, m in lora_layers(model).items() if n.rpartition(".")[2] in spec.target_modules]
    if not adapted:
        raise ValueError(f"no linear layer is named any of {list(spec.target_modules)}")
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    layers = lora_layers(model)
    for n in adapted:
        layers[n].add_adapter(name, spec, generator)
    sel.specs[name] = spec
    return adapted


def remove_adapter(model: nn.Module, name: str) -> None:
    sel = selection(model)
    if name not in sel.specs:
        raise KeyError(f"no adapter {name!r}")
    if sel.merged == name:
        raise ValueError(f"adapter {name!r} is merged; unmerge it first")
    for layer in lora_layers(model).values():
        layer.remove_adapter(name)
    del sel.specs[name]
    if sel.active == name:
        sel.active = None


def freeze_base(model: nn.Module) -> None:
    """requires_grad only on adapter parameters."""
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(pname))


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def apply_lora(
    model: nn.Module, spec: LoRASpec, adapters: Iterable[str] = ("default",), *, seed: int | None = 0
) -> list[str]:
    """Inject adapters (one per name in ``adapters``) into a built model and freeze everything else.

    The first adapter becomes active. Returns the names of the adapted linear layers. Call before FSDP.
    """
    adapters = list(adapters)
    if not adapters:
        raise ValueError("apply_lora needs at least one adapter name")
    adapted: list[str] = []
    for i, name in enumerate(adapters):
        adapted = add_adapter(model, name, spec, seed=None if seed is None else seed + i)
    for layer in lora_layers(model).values():
        if spec.rank > min(layer.in_features, layer.out_features):
            raise ValueError(
                f"LoRA rank {spec.rank} exceeds the smallest dimension of a targeted layer "
                f"({layer.in_features} -> {layer.out_features}); lower model.lora.rank"
            )
    freeze_base(model)
    set_active_adapter(model, adapters[0])
    return adapted


def set_active_adapter(model: nn.Module, name: str | None) -> None:
    """One adapter (or None: the base model) for every row of every following forward."""
    sel = selection(model)
    if name is not None and name not in sel.specs:
        raise KeyError(f"no adapter {name!r}; have {sorted(sel.specs)}")
    sel.active, sel.rows = name, None


@contextmanager
def use_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    sel = selection(model)
    before = (sel.active, sel.rows)
    set_active_adapter(model, name)
    try:
        yield
    finally:
        sel.active, sel.rows = before


def set_row_adapters(model: nn.Module, rows: list[str | None] | None) -> None:
    """Per batch row: the adapter name (or None for the base model). None clears it (``active`` applies again)."""
    sel = selection(model)
    if rows is not None:
        unknown = {r for r in rows if r is not None and r not in sel.specs}
        if unknown:
            raise KeyError(f"no adapter(s) {sorted(unknown)}; have {sorted(sel.specs)}")
        if all(r is None for r in rows):
            rows = [None] * len(rows)
    sel.rows = rows


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of one adapter (A and B of every adapted layer), in a stable order."""
    if name not in selection(model).specs:
        raise KeyError(f"no adapter {name!r}")
    out = []
    for layer in lora_layers(model).values():
        if name in layer.lora_A:
            out += [layer.lora_A[name].weight, layer.lora_B[name].weight]
    return out


@torch.no_grad()
def merge_adapter(model: nn.Module, name: str) -> None:
    """Fold ``name`` into the base weights (W += scale * B @ A); forwards then ignore the adapter selection."""
    sel = selection(model)
    if sel.merged is not None:
        raise ValueError(f"adapter {sel.merged!r} is already merged")
    for layer in lora_layers(model).values():
        if name in layer.lora_A:
            _add_to_weight(layer.weight, layer.delta_weight(name))
    sel.merged = name


@torch.no_grad()
def unmerge_adapter(model: nn.Module) -> None:
    """Undo `merge_adapter` (W -= scale * B @ A; exact up to floating-point rounding)."""
    sel = selection(model)
    if sel.merged is None:
        return
    for layer in lora_layers(model).values():
        if sel.merged in layer.lora_A:
            _add_to_weight(layer.weight, -layer.delta_weight(sel.merged))
    sel.merged = None


def _add_to_weight(weight: torch.Tensor, delta: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(weight, DTensor):
        delta = distribute_tensor(delta.to(weight.dtype), weight.device_mesh, weight.placements)
        weight.add_(delta)
    else:
        weight.add_(delta.to(weight.dtype))


def adapter_state_dict(
    model: nn.Module, name: str, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT key, CPU tensor) for adapter ``name``. Collective under FSDP: every rank must consume it."""
    if name not in selection(model).specs:
        raise KeyError(f"no adapter {name!r}")
    for module_name, layer in lora_layers(model).items():
        if name not in layer.lora_A:
            continue
        for ab, linear in (("A", layer.lora_A[name]), ("B", layer.lora_B[name])):
            t = _full(linear.weight).detach()
            if dtype is not None:
                t = t.to(dtype)
            yield f"{PEFT_PREFIX}{module_name}.lora_{ab}.weight", t.cpu().contiguous()


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
    """Spec and {module name: (A, B)}-ready tensors (PEFT keys) of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    p = Path(path)
    if not is_adapter_dir(p):
        raise ValueError(f"{p} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    spec = LoRASpec.from_peft_config(json.loads((p / ADAPTER_CONFIG).read_text()))
    return spec, load_file(str(p / ADAPTER_WEIGHTS))


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
