"""Opt-in `torch.compile` of the decoder layers (``parallel.compile_layers``), applied from outside the model files.

Eager PyTorch spends host time on every op of a layer (dispatch, autograd nodes, the elementwise wrappers of
`prime_models.kernels`): ~25 ops a layer forward and more in backward, whatever the row length. With short rows
(the RL loop's 2048 tokens a forward) that host time, not the GPU, bounds a forward/backward (issue 43). Compiled,
a layer's forward is one graph (matmuls and attention as library calls, the elementwise ops fused around them) and
its backward one autograd node.

What is compiled is the layer's own forward function, once for every layer of a class: its parameters are graph
inputs (dynamo's inlined modules), so all layers of a model share one graph (two when packed rows add an attention
mask). Hooks stay eager and outside: FSDP2's gathers, the one-rank path's parameter swap
(`prime_models.parallel.mixed_precision`) and activation checkpointing, whose recompute calls the compiled forward
again. Compiling changes the class of each layer in place (``Compiled<Layer>``; names, parameters and the module tree
stay), so it must come before activation checkpointing wraps the layer (`parallelize_transformer` and the trainer's
memory plan apply it in that order).

Numerics: the same ops in the same precision, but fused kernels may round and reduce in another order than eager
ones; the default (eager) path is the reference the parity tests hold.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from prime_models.layers.chunked_mlp import exclude_from_compile
from prime_models.parallel.activation_checkpoint import layer_checkpoint

COMPILE_BACKEND: str = "inductor"
"""`torch.compile` backend; tests use ``aot_eager`` (inductor's C++ build on CPU takes minutes on a small host)."""


class _CompiledLayer:
    """Mixed into a layer's class by `compile_layer`: its forward runs the class's compiled forward."""

    _compiled_forward: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return type(self)._compiled_forward(self, *args, **kwargs)


@functools.cache
def _compiled_class(cls: type) -> type:
    # One compiled function per layer class, so every layer of a model runs (and guards) the same graph.
    exclude_from_compile()
    compiled = torch.compile(cls.forward, backend=COMPILE_BACKEND)
    return type(f"Compiled{cls.__name__}", (_CompiledLayer, cls), {"_compiled_forward": staticmethod(compiled)})


def is_compiled(layer: nn.Module) -> bool:
    return isinstance(layer, _CompiledLayer)


def compile_layer(layer: nn.Module) -> None:
    """Run ``layer``'s forward compiled (in place; see the module docstring). Idempotent."""
    if is_compiled(layer):
        return
    if layer_checkpoint(layer) is not None:
        raise ValueError("compile a layer before activation checkpointing wraps it (its recompute must stay outside)")
    layer.__class__ = _compiled_class(type(layer))


def compile_layers(layers: nn.ModuleList) -> None:
    """Compile every decoder layer of ``layers`` (a model's ``model.model.layers``)."""
    for layer in layers:
        compile_layer(layer)
