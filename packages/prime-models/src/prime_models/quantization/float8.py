"""FP8 training as a model converter: swap a model's decoder matmuls for FP8 ones before FSDP wraps it (model files
stay untouched; torchtitan's `components/quantization/float8.py` is the same idea).

`convert_to_fp8(model, recipe=..., backend=...)` replaces every `nn.Linear` inside the decoder layers (attention and
MLP projections) by `Float8Linear`, and every `GroupedExperts` by `Float8GroupedExperts` (`float8_ops`: the recipes,
scaling and kernels). Parameters are moved, not copied: names, dtypes and FSDP sharding are unchanged, the optimizer
keeps updating the high-precision master weights, and checkpoints and HF exports look exactly as without FP8. The LM
head, the embeddings, the MoE router and the norms are never converted; nor is a linear whose in/out features are not
multiples of 16 (the FP8 GEMMs need that) or whose qualified name matches one of `skip` (fnmatch patterns, e.g.
``"*.o_proj"``). On GPUs without the grouped FP8 kernel (sm89) the MoE experts stay in bf16.

``backend="te"`` uses NVIDIA Transformer Engine's `te.Linear` instead (current scaling for ``tensorwise``,
1x128/128x128 block scaling for ``rowwise``); ``auto`` picks it when `transformer_engine` imports.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from prime_models.layers.moe import GroupedExperts
from prime_models.quantization.float8_ops import (
    ALIGN,
    Float8GroupedExperts,
    Float8Linear,
    get_recipe,
    scaled_grouped_mm_supported,
)

if TYPE_CHECKING:
    from prime_core.config.shared import Fp8Config

logger = logging.getLogger("prime.models")

BACKENDS = ("auto", "torch", "te")
TE_INSTALL_HINT = "pip install 'prime-models[fp8]' (or pip install 'transformer-engine[pytorch]')"


# --- Transformer Engine -----------------------------------------------------------------------------------------------


def transformer_engine():
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise ImportError(f"model.fp8.backend='te' needs NVIDIA Transformer Engine: {TE_INSTALL_HINT}") from e
    return te


def te_recipe(te, recipe: str):
    from transformer_engine.common import recipe as te_recipes

    if recipe == "tensorwise":
        # Per-tensor scales from the current tensor (not an amax history): e4m3 forward, e5m2 gradients, as ours.
        return te_recipes.Float8CurrentScaling(fp8_format=te_recipes.Format.HYBRID)
    return te_recipes.Float8BlockScaling()


def te_linear(linear: nn.Linear, recipe: str) -> nn.Module:
    """A `te.Linear` holding `linear`'s own parameters, running under FP8 autocast in its forward."""
    te = transformer_engine()
    te_fp8 = te_recipe(te, recipe)
    autocast = getattr(te, "autocast", None)

    class TELinear(te.Linear):
        # No `_extra_state` in state dicts: scales are recomputed every step, and HF export / DCP see plain Linears.
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x):
            ctx = autocast(recipe=te_fp8) if autocast is not None else te.fp8_autocast(enabled=True, fp8_recipe=te_fp8)
            with ctx:
                return super().forward(x)

    new = TELinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   params_dtype=linear.weight.dtype, device=linear.weight.device)  # fmt: skip
    new.weight = linear.weight
    if linear.bias is not None:
        new.bias = linear.bias
    return new


# --- conversion ---------------------------------------------------------------------------------------------------


def check_fp8_device(device: torch.device, recipe: str) -> None:
    """One-line error on devices without FP8 GEMMs (CUDA before compute capability 8.9); CPU runs for tests."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"model.fp8.recipe={recipe!r} needs an FP8 GPU (compute capability >= 8.9, Ada/Hopper or newer); "
                f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: use model.fp8.recipe='none'"
            )
    elif device.type != "cpu":
        raise ValueError(f"model.fp8.recipe={recipe!r} is not supported on {device.type}: use 'none'")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"model.fp8.backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "te" if importlib.util.find_spec("transformer_engine") is not None else "torch"
    return backend


def fp8_linear_filter(name: str, module: nn.Module, skip: tuple[str, ...] = ()) -> bool:
    """Whether the linear `name` gets FP8 GEMMs: dims multiples of 16 and no `skip` pattern matching its name."""
    if type(module) is not nn.Linear:
        return False
    if module.in_features % ALIGN or module.out_features % ALIGN:
        return False
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def convert_to_fp8(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    backend: str = "torch",
    skip: tuple[str, ...] | list[str] = (),
    moe: bool = True,
) -> dict[str, int]:
    """Swap the decoder layers' linears (and MoE experts) of `model` for FP8 versions in place, before FSDP.

    Only modules under `model.model.layers` are candidates, so the LM head and embeddings keep high precision.
    `skip` holds fnmatch patterns on qualified names (e.g. ``"model.layers.0.*"``, ``"*.down_proj"``). Returns how
    many modules were converted per kind, and logs what was skipped.
    """
    if recipe == "none":
        return {}
    fp8 = get_recipe(recipe)
    backend = resolve_backend(backend)
    param_device = next(model.parameters()).device
    check_fp8_device(param_device, recipe)
    if param_device.type == "cpu":
        logger.warning("fp8 on CPU: tensorwise uses torch's CPU kernel, the rest is emulated; for tests, not speed")
    skip = tuple(skip)
    converted = {"linear": 0, "experts": 0}
    left: list[str] = []
    layers = model.model.layers
    device = next(layers.parameters()).device
    grouped_ok = device.type == "cpu" or scaled_grouped_mm_supported(device)
    if moe and not grouped_ok and any(type(m) is GroupedExperts for m in layers.modules()):
        logger.warning("fp8: torch._scaled_grouped_mm needs sm90+; MoE experts stay in bf16 on this GPU")

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in list(module.named_children()):
            fqn = f"{prefix}.{child_name}"
            if isinstance(child, nn.Linear):
                # Never descend into a linear: sub-layers of a wrapped linear (LoRA adapters) belong to it.
                if fp8_linear_filter(fqn, child, skip):
                    new = te_linear(child, recipe) if backend == "te" else Float8Linear.from_linear(child, fp8)
                    setattr(module, child_name, new)
                    converted["linear"] += 1
                else:
                    left.append(fqn)
            elif type(child) is GroupedExperts:
                if moe and grouped_ok and backend != "te" and not any(fnmatch.fnmatchcase(fqn, p) for p in skip):
                    setattr(module, child_name, Float8GroupedExperts.from_experts(child))
                    converted["experts"] += 1
                else:
                    left.append(fqn)
            else:
                walk(child, fqn)

    walk(layers, "model.layers")
    if left:
        shown = ", ".join(left[:8]) + (", ..." if len(left) > 8 else "")
        logger.info("fp8: kept %d modules in high precision: %s", len(left), shown)
    logger.info("fp8 (%s, %s backend): converted %s", recipe, backend, converted)
    return converted


def apply_fp8(model: nn.Module, config: Fp8Config | None) -> dict[str, int]:
    """`convert_to_fp8` from a `model.fp8` config section (a no-op when unset or ``recipe = "none"``)."""
    if config is None or config.recipe == "none":
        return {}
    return convert_to_fp8(model, config.recipe, backend=config.backend, skip=config.skip, moe=config.moe)
