"""A CPU stand-in for `torch.cuda.make_graphed_callables` that keeps its contract where it matters to the dispatch in
`prime_models.parallel.cuda_graphs`: eager warmups on the real parameters first, static input tensors copied into at
every call, one static output and one static gradient buffer per parameter reused by every call (so a gradient left
on a parameter after its backward is overwritten by the next one, as a replay would), gradients of the parameters
captured at "capture" time returned from one autograd node, and no ``.grad`` written while "capturing". The forward
re-runs the module's Python on the static inputs (with the captured parameters), so numerics equal eager ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from prime_models.parallel import cuda_graphs as G
from torch import nn


def make_graphed_on_cpu(module: nn.Module, sample_args: tuple[torch.Tensor, ...], pool: Any) -> Callable:
    assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
    named = dict(module.named_parameters())
    names, params = list(named), tuple(named.values())
    grads_before = [p.grad for p in params]
    # torch's warmups: eager forward/backwards on the real parameters, gradients through `autograd.grad`.
    for _ in range(G.NUM_WARMUP_ITERS):
        out = module(*sample_args)
        torch.autograd.grad(out, [p for p in params if p.requires_grad], torch.ones_like(out), allow_unused=True)
    num_user = len(sample_args)
    static: dict[str, Any] = {"out": None, "grads": [None] * len(params)}

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs: torch.Tensor) -> torch.Tensor:
            for s, x in zip(sample_args, inputs[:num_user], strict=True):
                s.copy_(x)
            with torch.enable_grad():
                leaves = [p.detach().requires_grad_(p.requires_grad) for p in inputs[num_user:]]
                for leaf, p in zip(leaves, params, strict=True):
                    if hasattr(p, "main_grad"):  # a captured graph sums into the same fp32 gradients
                        leaf.main_grad = p.main_grad
                out = torch.func.functional_call(module, dict(zip(names, leaves, strict=True)), sample_args)
            ctx.out, ctx.leaves = out, leaves
            if static["out"] is None:
                static["out"] = torch.empty_like(out)
            static["out"].copy_(out.detach())
            return static["out"].detach()

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            wanted = [leaf for leaf in ctx.leaves if leaf.requires_grad]
            got = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
            result = []
            for i, leaf in enumerate(ctx.leaves):
                g = next(got) if leaf.requires_grad else None
                if g is not None:
                    if static["grads"][i] is None:
                        static["grads"][i] = torch.empty_like(g)
                    static["grads"][i].copy_(g)
                    g = static["grads"][i].detach()
                result.append(g)
            return (None,) * num_user + tuple(result)

    def replay(*user_args: torch.Tensor) -> torch.Tensor:
        return Replay.apply(*user_args, *params)

    assert all(p.grad is g for p, g in zip(params, grads_before, strict=True))
    return replay


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Dispatch CPU forwards through `make_graphed_on_cpu` as CUDA ones would go through CUDA graphs."""
    monkeypatch.setattr(G, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(G, "make_graphed", make_graphed_on_cpu)
