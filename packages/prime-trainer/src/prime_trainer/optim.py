"""AdamW, the learning-rate schedule (a pure function of the step), gradient clipping and the guard that skips a step
whose gradients are not finite."""

from __future__ import annotations

import logging
import math

import torch
from prime_core.config.trainer import AdamWConfig, CosineSchedulerConfig, SchedulerConfig
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger("prime.trainer")


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


class NonFiniteGradients(RuntimeError):
    """More optimizer steps in a row had a NaN or infinite gradient norm (or no loss token) than
    ``optim.max_skipped_steps`` allows."""


class SkippedSteps:
    """Skips the optimizer step of a non-finite gradient norm, as verl does: one NaN (a NaN or overflowing loss, a
    broken sample) would otherwise write NaN into every weight, which the trainer then publishes to inference and
    checkpoints, and every later rollout is garbage. A skipped step leaves the weights and AdamW's moments and step
    count as they were. Past ``limit`` skips in a row the run stops: the cause is no longer one batch."""

    def __init__(self, limit: int, what: str = "") -> None:
        self.limit = limit
        self.what = what
        self.in_a_row = 0

    def admit(self, grad_norm: float, step: int, *, no_loss_tokens: bool = False) -> bool:
        """Whether step ``step`` may apply its gradients; raises `NonFiniteGradients` past the limit. A step without a
        loss token on any rank is skipped too: its gradient is zero, yet AdamW's moments and weight decay would still
        move every weight on a step that held nothing to learn from."""
        if math.isfinite(grad_norm) and not no_loss_tokens:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if no_loss_tokens:
            line = f"step {step}{self.what}: no loss token on any rank (every loss_mask of the step is 0)"
            cause = "the rollouts hold nothing to train on every step"
        else:
            line = f"step {step}{self.what}: gradient norm is {grad_norm}"
            cause = "the loss or the data is not finite every step, or the weights already are"
        if self.in_a_row > self.limit:
            raise NonFiniteGradients(
                f"{line}, {self.in_a_row} steps in a row (optim.max_skipped_steps = {self.limit}): {cause}"
            )
        logger.warning("%s: optimizer step skipped, weights unchanged (%d in a row)", line, self.in_a_row)
        return False
