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
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=True if on_cuda else None)


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
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
