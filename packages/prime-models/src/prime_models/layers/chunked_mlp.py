"""Sequence-chunked MLP for fully checkpointed decoder layers: a lower backward peak at no extra compute.

Under full activation checkpointing a layer's backward recomputes the whole layer, so every MLP intermediate (the
`[tokens, intermediate]` gate and up projections, the activation and their gradients) is alive at once; at long
context that is the step's memory peak. `chunked_mlp` runs the MLP as one autograd node that keeps only its input:
forward computes the output chunk by chunk without a graph; backward recomputes one sequence chunk at a time with a
graph and takes that chunk's input and parameter gradients, so only one chunk's intermediates are alive.

The checkpoint's own recompute of the layer would run the MLP forward once more only to produce an output that nobody
reads (backward needs just the saved input). Inside `skipping_chunked_mlp_forward` (the recompute context that
`skip_chunked_mlp_in_recompute` adds to a checkpoint's `context_fn`) the node saves its input and returns a zero
placeholder without computing, so the MLP forward still runs twice per step (forward and backward), as without
chunking.

Shape legend: B batch, S sequence, H hidden.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from prime_models import kernels

_SKIP_FORWARD = contextvars.ContextVar("prime_models_skip_chunked_mlp_forward", default=False)


@contextlib.contextmanager
def skipping_chunked_mlp_forward() -> Iterator[None]:
    """Chunked MLPs called inside save their input and return a placeholder instead of computing."""
    token = _SKIP_FORWARD.set(True)
    try:
        yield
    finally:
        _SKIP_FORWARD.reset(token)


@contextlib.contextmanager
def _entered(*contexts) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def skip_chunked_mlp_in_recompute(context_fn: Callable[[], tuple]) -> Callable[[], tuple]:
    """A `torch.utils.checkpoint` `context_fn` whose recompute context also skips chunked MLP forwards."""

    def combined() -> tuple:
        forward_context, recompute_context = context_fn()
        return forward_context, _entered(recompute_context, skipping_chunked_mlp_forward())

    return combined


def chunk_bounds(length: int, num_chunks: int) -> list[tuple[int, int]]:
    """`num_chunks` (at most `length`) contiguous ranges covering `[0, length)`, sizes differing by at most one."""
    n = max(1, min(num_chunks, length))
    edges = [length * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class _ForwardState:
    """RNG and autocast state of the forward, restored for the backward's recompute (dropout in LoRA adapters)."""

    def __init__(self, x: torch.Tensor):
        self.device_type = x.device.type
        self.cpu_rng = torch.get_rng_state()
        # Under a CUDA graph capture the device's RNG state cannot be read (nor is LoRA dropout graphed).
        self.devices, self.device_rng = ([], []) if kernels.capturing(x) else get_device_states(x)
        self.autocast = torch.is_autocast_enabled(self.device_type)
        self.autocast_dtype = torch.get_autocast_dtype(self.device_type)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        rng_device_type = self.device_type if self.devices else "cuda"
        with torch.random.fork_rng(devices=self.devices, device_type=rng_device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            with torch.amp.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
                yield


class _ChunkedMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_BSH: torch.Tensor, mlp: nn.Module, fn: Callable, num_chunks: int, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x_BSH)
        if _SKIP_FORWARD.get():
            # A zero-stride view: the recompute's output is discarded, so it needs no memory.
            return x_BSH.new_zeros(()).expand(x_BSH.shape)
        ctx.mlp, ctx.fn, ctx.num_params = mlp, fn, len(params)
        ctx.bounds = chunk_bounds(x_BSH.shape[1], num_chunks)
        ctx.state = _ForwardState(x_BSH)
        out_BSH = None
        for start, end in ctx.bounds:
            y = fn(x_BSH[:, start:end])
            if out_BSH is None:
                out_BSH = y.new_empty((*x_BSH.shape[:-1], y.shape[-1]))
            out_BSH[:, start:end] = y
        return out_BSH

    @staticmethod
    def backward(ctx, grad_BSH: torch.Tensor):
        (x_BSH,) = ctx.saved_tensors
        mlp = ctx.mlp
        # The module's parameters now: under FSDP2 the same unsharded tensors as in forward, gathered again.
        params = [p for p in mlp.parameters() if p.requires_grad]
        assert len(params) == ctx.num_params, (
            "the chunked MLP's trainable parameters changed between forward and backward"
        )
        need_x = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(x_BSH) if need_x else None
        # Summed over chunks in fp32 and cast once, so bf16 parameters see one rounding, as without chunking.
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        with torch.enable_grad(), ctx.state.restored():
            for start, end in ctx.bounds:
                x_chunk = x_BSH[:, start:end].detach().requires_grad_(need_x)
                y = ctx.fn(x_chunk)
                if not y.requires_grad:
                    continue
                inputs = ([x_chunk] if need_x else []) + params
                grads = torch.autograd.grad(y, inputs, grad_BSH[:, start:end], allow_unused=True)
                if need_x:
                    grad_x[:, start:end] = grads[0] if grads[0] is not None else 0
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        grad_params[i] = g.float() if grad_params[i] is None else grad_params[i].add_(g)
        grad_params = [g if g is None else g.to(p.dtype) for g, p in zip(grad_params, params, strict=True)]
        return grad_x, None, None, None, *grad_params


def chunked_mlp(mlp: nn.Module, x_BSH: torch.Tensor, num_chunks: int, forward: Callable | None = None) -> torch.Tensor:
    """`mlp(x_BSH)`, keeping only `x_BSH` for backward and recomputing it there in `num_chunks` sequence chunks.

    `mlp` must act on each token independently (a dense MLP of any `nn.Linear` subclass: LoRA, FP8); its parameters
    that require grad at call time (under FSDP2 the unsharded ones) get their gradients through autograd as usual.
    `forward` computes the MLP on a chunk (default: `mlp` itself).
    """
    params = [p for p in mlp.parameters() if p.requires_grad]
    return _ChunkedMLP.apply(x_BSH, mlp, forward or mlp, num_chunks, *params)


def exclude_from_compile() -> None:
    """Make compiled layers (`prime_models.parallel.compile`) run the chunked MLPs eagerly between their graphs: its
    forward reads a context variable and the RNG state, which dynamo does not trace. Called before a layer is
    compiled rather than at import, because `torch.compiler.disable` imports dynamo (and sympy): seconds of start-up
    in every process that only imports the model code. Idempotent; `chunked_mlp` itself stays the plain function."""
    global _chunked_mlp_in_layers
    if _chunked_mlp_in_layers is chunked_mlp:
        _chunked_mlp_in_layers = torch.compiler.disable(chunked_mlp)


_chunked_mlp_in_layers: Callable[..., torch.Tensor] = chunked_mlp
"""What a chunked MLP's forward calls: `chunked_mlp`, hidden from dynamo once `exclude_from_compile` ran."""


class _ChunkedForward:
    """Mixed into a dense MLP's class by `chunk_mlp`: its forward runs through `chunked_mlp` while autograd records."""

    mlp_chunks: int

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _chunked_mlp_in_layers(self, x_BSH, self.mlp_chunks, forward=super().forward)
        return super().forward(x_BSH)


@functools.cache
def _chunked_class(cls: type) -> type:
    return type(f"Chunked{cls.__name__}", (_ChunkedForward, cls), {})


def chunk_mlp(mlp: nn.Module, num_chunks: int) -> None:
    """Make `mlp` run in `num_chunks` sequence chunks when it records a graph. In place, as FSDP2's `fully_shard`
    swaps a module's class: its parameters, names and children stay; only the forward changes."""
    if not isinstance(mlp, _ChunkedForward):
        mlp.__class__ = _chunked_class(type(mlp))
    mlp.mlp_chunks = num_chunks
