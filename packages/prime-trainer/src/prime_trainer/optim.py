"""AdamW, the learning-rate schedule (a pure function of the step) and gradient clipping."""

from __future__ import annotations

import math

import torch
from prime_core.config.trainer import AdamWConfig, CosineSchedulerConfig, SchedulerConfig
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(model: nn.Module, config: AdamWConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # Norm weights and biases are 1-D; decaying them only hurts.
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # On CUDA the fused kernel does the whole update in one pass per tensor group: faster than foreach and without
    # its parameter-sized temporaries (which set the step's peak memory). CPU keeps the default implementation.
    on_cuda = bool(decay or no_decay) and (decay + no_decay)[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=True if on_cuda else None
    )
    return optimizer


def lr_at(step: int, lr: float, scheduler: SchedulerConfig, max_steps: int) -> float:
    """Learning rate of (0-indexed) step ``step``: linear warmup (step 0 trains at lr / warmup), then the schedule."""
    warmup = scheduler.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if isinstance(scheduler, CosineSchedulerConfig):
        decay_steps = max(max_steps - warmup - 1, 1)
        progress = min((step - warmup) / decay_steps, 1.0)
        return scheduler.min_lr + (lr - scheduler.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm (over every rank's shard) and return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    # Under expert parallelism expert gradients are DTensors on another mesh than the dense ones, and DTensor norms
    # of different meshes do not mix: reduce each mesh's norm to a plain tensor, then combine.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm is not None:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)
