"""LoRA in the trainer: publishing adapters instead of full weights, and the per-run optimizer layout.

With ``model.lora`` set, `prime_trainer.model.build_model` injects adapters before FSDP and freezes the base; the
optimizer only sees adapter parameters (``build_optimizer`` skips frozen ones). Each published step
``weights/step_N`` then holds the adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``)
plus ``prime_adapter.json`` naming it, and the STABLE marker: inference loads it as a LoRA adapter on the base
model it already serves. DCP checkpoints hold the adapters and their optimizer state (the frozen base is reloaded
from ``model.name`` on resume).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from prime_core.config.trainer import AdamWConfig
from prime_core.io import atomic_dir, atomic_write_text
from prime_core.run_dir import RunDir
from prime_core.schemas.adapters import ADAPTER_INFO, AdapterInfo
from prime_models.lora import adapter_parameters, save_adapter
from torch import nn

from prime_trainer.weights import WeightPublisher
from prime_trainer.world import World, broadcast_object


class AdapterPublisher(WeightPublisher):
    """Publishes one LoRA adapter as ``weights/step_N`` of ``run_dir`` (same retention rules as full weights)."""

    def __init__(
        self, run_dir: RunDir, world: World, async_level: int, keep_all: bool, *, adapter: str, base_model: str
    ):
        super().__init__(run_dir, world, base_model, async_level, keep_all)
        self.adapter = adapter
        self.base_model = base_model
        self.last_timings: dict[str, float] = {}

    def publish(self, step: int, model: nn.Module, checkpoint_steps: list[int] = (), **_) -> Path:
        """Collective over the trainer's ranks (adapter shards are gathered); rank 0 writes."""
        final = self.run_dir.weight_step(step)
        info = AdapterInfo(name=self.adapter, step=step, base_model=self.base_model)
        t0 = time.perf_counter()
        if self.world.is_master:
            with atomic_dir(final) as tmp:
                broadcast_object(str(tmp))
                save_adapter(model, self.adapter, tmp, base_model=self.base_model, dtype=self.dtype)
                atomic_write_text(tmp / ADAPTER_INFO, info.model_dump_json(indent=2) + "\n")
            self._cleanup(step, checkpoint_steps)
        else:
            tmp = broadcast_object(None)
            save_adapter(model, self.adapter, tmp, base_model=self.base_model, dtype=self.dtype)
        broadcast_object(None)  # nobody moves on before STABLE is written
        self.last_timings = {"files_s": time.perf_counter() - t0}
        return final


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
        raise ValueError(
            f"model.lora with a randomly initialized base ({config.model.name} has no weights, or init.random): "
            "inference serves model.name's weights plus the adapter, so the base must be a checkpoint on disk"
        )


def setup_lora(c) -> None:
    """With ``model.lora``: publish the adapter instead of full weights (``c`` is `prime_trainer.common.Components`)."""
    lora = c.config.model.lora
    if lora is None:
        return
    check_base_on_disk(c.config, c.model_source.random_init)
    c.publisher = AdapterPublisher(
        c.run_dir,
        c.world,
        c.config.async_level,
        c.publisher.keep_all,
        adapter=lora.adapter_name,
        base_model=c.config.model.name,
    )
