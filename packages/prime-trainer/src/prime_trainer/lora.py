"""LoRA in the trainer: the checks of a LoRA run and the per-run optimizer layout.

With ``model.lora`` set, `prime_trainer.model.build_model` injects adapters before FSDP and freezes the base; the
optimizer only sees adapter parameters (``build_optimizer`` skips frozen ones). Each published step is the adapter
(the adapter weight transport, `prime_trainer.weights.adapter`): inference loads it as a LoRA adapter on the base
model it already serves. DCP checkpoints hold the adapters and their optimizer state (the frozen base is reloaded
from ``model.name`` on resume).
"""

from __future__ import annotations

import torch
from prime_core.config import ConfigError
from prime_core.config.trainer import AdamWConfig
from prime_models.lora import adapter_parameters
from torch import nn


def build_run_optimizer(model: nn.Module, runs: list[tuple[str, float]], config: AdamWConfig) -> torch.optim.Optimizer:
    """One AdamW with a parameter group per adapter (``runs``: (adapter, peak lr)).

    AdamW's update is elementwise per parameter, so per-adapter groups with per-adapter gradient clipping (see
    `clip_adapter_grad_norm`) are exactly independent optimizers, in one object that DCP checkpoints as usual.
    """
    groups = [
        {"params": adapter_parameters(model, name), "lr": lr, "weight_decay": config.weight_decay, "adapter": name}
        for name, lr in runs
    ]
    on_cuda = groups[0]["params"][0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=runs[0][1], betas=config.betas, eps=config.eps, fused=True if on_cuda else None)


def clip_adapter_grad_norm(model: nn.Module, adapter: str, max_norm: float | None) -> float:
    """Clip the gradient norm of one adapter's parameters (global over ranks); returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in adapter_parameters(model, adapter) if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def check_base_on_disk(config, random_init: bool) -> None:
    """A LoRA run publishes adapters for inference's copy of the base: that base must exist outside the trainer."""
    if random_init and config.weights.publish and not config.bench:
        raise ConfigError(
            f"model.lora with a randomly initialized base ({config.model.name} has no weights, or init.random): "
            "inference serves model.name's weights plus the adapter, so the base must be a checkpoint on disk"
        )


def setup_lora(c) -> None:
    """With ``model.lora``: check what the run's published adapters need (``c`` is `prime_trainer.common.Components`;
    `prime_trainer.weights.build_publisher` already chose the adapter transport)."""
    if c.config.model.lora is not None:
        check_base_on_disk(c.config, c.model_source.random_init)
