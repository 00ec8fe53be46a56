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
tensor), the fused log-prob head (`prime_models.fused_head`), which reads the same attribute, and every plain
``nn.Embedding``, whose backward adds only the looked-up rows into ``main_grad`` (the dense backward writes a
``[vocab, hidden]`` bf16 gradient that the hook then adds whole: 155M values a micro-batch at Qwen3's vocabulary). A
master's ``main_grad`` is persistent (CUDA graphs replay into its address), zeroed when a forward starts while the
master has no gradient (after ``zero_grad``), and becomes the master's ``.grad`` when a backward ends. Other
parameters (norms, biases) keep the hook path and are added into the same buffer.

CUDA graphs (`prime_models.parallel.cuda_graphs`) run warmup forward/backwards before a capture; their gradients
must not reach the masters. Inside `discarding_outside_capture` the accumulation runs only while a graph records.
Under ``torch.compile`` (compiled layers) the accumulation is a custom op that mutates ``main_grad``, so the flag is
read when it runs, not when it was traced; eager backwards call the function itself (the op's dispatch costs ~40 us a
call on a CPU core, 12,544 calls a step at one row a forward).
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


def _register_accumulate_ops() -> None:
    # Custom ops that mutate `main_grad`, opaque to dynamo: a compiled layer's backward calls them at run time (the
    # flag above is read then). Registered by `fuse_modules`, not at import (torch.library's start-up cost).
    if not hasattr(torch.ops.prime_models, "accumulate_weight_grad_"):
        torch.library.custom_op(
            "prime_models::accumulate_weight_grad_", _accumulate_matmul, mutates_args=("main_grad",)
        )
    if not hasattr(torch.ops.prime_models, "accumulate_embedding_grad_"):
        torch.library.custom_op(
            "prime_models::accumulate_embedding_grad_", _accumulate_rows, mutates_args=("main_grad",)
        )


def _accumulate_matmul(main_grad: torch.Tensor, grad_out_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    if not _discarding or kernels.capturing(main_grad):
        kernels.accumulate_matmul(main_grad, grad_out_NO.T, x_NI)


def _accumulate_rows(main_grad: torch.Tensor, ids_N: torch.Tensor, grad_NH: torch.Tensor) -> None:
    # Only the looked-up rows, where the dense embedding backward writes and adds the whole [vocab, hidden] table.
    # index_add_ adds with atomics on CUDA: a repeated token's rows sum in no fixed order (last-bit differences
    # between runs) unless torch.use_deterministic_algorithms is on, where torch sorts first. index_put_'s
    # accumulation always sorts and cost ~14 ms a 16k-token micro-batch on an H100 (eight rows of 2048: -5%).
    if not _discarding or kernels.capturing(main_grad):
        main_grad.index_add_(0, ids_N, grad_NH.float())


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, main_grad: torch.Tensor):
        # Not saved for backward: other backwards (a tied weight's) add into it first, which a saved tensor's version
        # check would reject.
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.has_bias = main_grad, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_out_NO = grad_out.reshape(-1, grad_out.shape[-1])
        accumulate = (
            torch.ops.prime_models.accumulate_weight_grad_ if torch.compiler.is_compiling() else _accumulate_matmul
        )
        accumulate(main_grad, grad_out_NO, x.reshape(-1, x.shape[-1]))
        grad_bias = grad_out_NO.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor):
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_NH = grad_out.reshape(-1, grad_out.shape[-1])
        accumulate = (
            torch.ops.prime_models.accumulate_embedding_grad_ if torch.compiler.is_compiling() else _accumulate_rows
        )
        accumulate(main_grad, ids.reshape(-1), grad_NH)
        return None, None, None


def _main_grad_in_use(module: nn.Module) -> torch.Tensor | None:
    main_grad = getattr(module.weight, "main_grad", None)
    if main_grad is None or not torch.is_grad_enabled() or not module.weight.requires_grad:
        return None
    return main_grad


class _MainGradLinear(nn.Linear):
    """An ``nn.Linear`` whose class `fuse_modules` swapped: while its weight carries a ``main_grad`` (the working copy
    inside a forward), the weight gradient goes there; otherwise it is a plain linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main_grad = _main_grad_in_use(self)
        if main_grad is None:
            return F.linear(x, self.weight, self.bias)
        return _LinearIntoMainGrad.apply(x, self.weight, self.bias, main_grad)


class _MainGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (no padding row, norm limit or sparse gradient) whose class `fuse_modules` swapped: the
    looked-up rows' gradients go into the weight's ``main_grad`` when it has one."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        main_grad = _main_grad_in_use(self)
        if main_grad is None:
            return super().forward(ids)
        return _EmbeddingIntoMainGrad.apply(ids, self.weight, main_grad)


def _fusable_embedding(m: nn.Module) -> bool:
    return type(m) is nn.Embedding and m.padding_idx is None and m.max_norm is None and not m.sparse


def fuse_modules(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Swap the class of every plain ``nn.Linear`` and ``nn.Embedding`` in ``model`` (in place; names, parameters and
    hooks stay) and return them with their classes, for `unfuse_modules`."""
    _register_accumulate_ops()
    swapped = []
    for m in model.modules():
        fused = _MainGradLinear if type(m) is nn.Linear else _MainGradEmbedding if _fusable_embedding(m) else None
        if fused is not None:
            swapped.append((m, type(m)))
            m.__class__ = fused
    return swapped


def unfuse_modules(swapped: list[tuple[nn.Module, type]]) -> None:
    for m, cls in swapped:
        m.__class__ = cls
