"""Weight gradients summed in fp32 inside their matmuls, for the one-rank mixed precision (``main_grad``).

On one rank (`prime_models.parallel.mixed_precision`) backward leaves each micro-batch's weight gradients in bf16 on
the working copy, and a hook adds them to the fp32 masters' gradients: per micro-batch one bf16 gradient written and
read again, and one fp32 read-modify-write of every parameter in ~300 unvectorized mixed-dtype kernels. With one
2048-token row a forward (the RL loop's shape: 64 micro-batches a step) that was ~180 ms of a 2.3 s step on an H100
(issue 43), the largest part of what one row a forward costs over eight.

Here the weight-gradient matmul itself accumulates into the master's fp32 gradient: ``main_grad += grad_out.T @ x`` in
one cuBLAS call with an fp32 output (`prime_models.kernels.accumulate_matmul`), as Megatron-LM's gradient
accumulation fusion does. On an H100 that call takes no longer than the bf16 matmul alone (3.9 against 4.1 ms for
the decoder stack's weight gradients of one 2048-token row), so the separate add disappears. The sum is exact fp32
of the bf16 products: no rounding of each micro-batch's gradient to bf16 (FSDP2 rounds there).

What takes part: every ``nn.Linear`` (the exact class: FP8 and LoRA linears keep their own backward) whose working
weight carries a ``main_grad`` attribute (`MixedPrecision.accumulate_in_matmuls` sets it on every trainable working
tensor), and the fused log-prob head (`prime_models.fused_head`), which reads the same attribute. A master's
``main_grad`` is persistent (CUDA graphs replay into its address), zeroed when a forward starts while the master
has no gradient (after ``zero_grad``), and becomes the master's ``.grad`` when a backward ends. Other parameters
(norms, embeddings) keep the hook path and are added into the same buffer.

CUDA graphs (`prime_models.parallel.cuda_graphs`) run warmup forward/backwards before a capture; their gradients
must not reach the masters. Inside `discarding_outside_capture` the accumulation runs only while a graph records.
Under ``torch.compile`` (compiled layers) the accumulation is a custom op that mutates ``main_grad``, so the flag is
read when it runs, not when it was traced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from prime_models import kernels

ALLOWED: bool = os.environ.get("PRIME_MAIN_GRAD", "1") != "0"
"""Whether the trainer may turn this on (`PRIME_MAIN_GRAD=0`: the bf16-gradient path, for A/B benchmarks)."""
_discarding = 0
"""Nesting depth of `discarding_outside_capture`: a module global, since backward runs on autograd's threads."""


@contextlib.contextmanager
def discarding_outside_capture() -> Iterator[None]:
    """Weight gradients reach ``main_grad`` only while a CUDA graph records (warmups before a capture)."""
    global _discarding
    _discarding += 1
    try:
        yield
    finally:
        _discarding -= 1


def _accumulate(main_grad: torch.Tensor, grad_out_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    if _discarding and not kernels.capturing(main_grad):
        return
    kernels.accumulate_matmul(main_grad, grad_out_NO.T, x_NI)


def _register_accumulate_op() -> None:
    # A custom op that mutates `main_grad`, opaque to dynamo: a compiled layer's backward calls `_accumulate` at run
    # time (the flag above is read then). Registered by `fuse_linears`, not at import (torch.library's start-up cost).
    if not hasattr(torch.ops.prime_models, "accumulate_weight_grad_"):
        torch.library.custom_op("prime_models::accumulate_weight_grad_", _accumulate_into, mutates_args=("main_grad",))


def _accumulate_into(main_grad: torch.Tensor, grad_out_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    _accumulate(main_grad, grad_out_NO, x_NI)


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, main_grad: torch.Tensor):
        ctx.save_for_backward(x, weight, main_grad)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, main_grad = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_out_NO = grad_out.reshape(-1, grad_out.shape[-1])
        torch.ops.prime_models.accumulate_weight_grad_(main_grad, grad_out_NO, x.reshape(-1, x.shape[-1]))
        grad_bias = grad_out_NO.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class _MainGradLinear(nn.Linear):
    """An ``nn.Linear`` whose class `fuse_linears` swapped: while its weight carries a ``main_grad`` (the working copy
    inside a forward), the weight gradient goes there; otherwise it is a plain linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        return _LinearIntoMainGrad.apply(x, self.weight, self.bias, main_grad)


def fuse_linears(model: nn.Module) -> list[nn.Module]:
    """Swap the class of every plain ``nn.Linear`` in ``model`` (in place; names, parameters and hooks stay) and
    return them, for `unfuse_linears`."""
    _register_accumulate_op()
    swapped = [m for m in model.modules() if type(m) is nn.Linear]
    for m in swapped:
        m.__class__ = _MainGradLinear
    return swapped


def unfuse_linears(modules: list[nn.Module]) -> None:
    for m in modules:
        if type(m) is _MainGradLinear:
            m.__class__ = nn.Linear
