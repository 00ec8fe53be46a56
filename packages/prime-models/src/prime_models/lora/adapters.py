"""LoRA layers and adapter bookkeeping: `LoRALinear`, apply / add / remove / select / merge adapters on a model."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from prime_core.config.shared import LORA_TARGET_MODULES
from prime_core.schemas.adapters import ADAPTER_NAME_PATTERN
from torch import nn

DEFAULT_TARGET_MODULES = LORA_TARGET_MODULES
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)


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
