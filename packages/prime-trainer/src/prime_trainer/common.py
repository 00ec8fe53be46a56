"""Setup and per-step plumbing shared by the RL and SFT trainers (everything but the step's loss)."""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prime_core.config import write_config
from prime_core.config.trainer import SFTConfig, TrainerConfig
from prime_core.io import atomic_write_json, is_stable
from prime_core.logging import setup_logging
from prime_core.monitor import Monitor, build_monitor
from prime_core.preflight import lora_record
from prime_core.run_dir import RunDir
from prime_models import flops_per_token
from prime_models.parallel.context_parallel import ContextParallel
from torch import nn
from torch.distributed.fsdp import FSDPModule

from prime_trainer import perf
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.memory import MemoryPlan
from prime_trainer.model import ModelSource, build_model, loss_scale
from prime_trainer.optim import SkippedSteps, build_optimizer, clip_grad_norm, lr_at, set_lr
from prime_trainer.parallel import TrainerLayout, build_layout
from prime_trainer.weights import WeightPublisher, build_publisher
from prime_trainer.world import World, init_world


@dataclass
class Components:
    config: TrainerConfig | SFTConfig
    process: str
    world: World
    run_dir: RunDir
    logger: logging.Logger
    model: nn.Module
    model_source: ModelSource
    """Where the model came from: its HF config, tokenizer, directory, and whether it was initialized randomly."""
    optimizer: torch.optim.Optimizer
    ckpt: CheckpointManager
    publisher: WeightPublisher
    monitor: Monitor | None
    """Metrics sink, on rank 0 outside bench runs."""
    peak_flops: float | None
    loss_scale: float
    step_times: list[dict[str, float]] = field(default_factory=list)
    """Every step's metrics, for the bench summary (bench runs only)."""
    layout: TrainerLayout | None = None
    """Parallel layout (meshes, expert and context parallelism)."""
    memory_plan: MemoryPlan | None = None
    """Activation checkpointing in use; set before the first forward (`prime_trainer.memory.plan_memory`)."""
    skipped_steps: SkippedSteps = field(default_factory=lambda: SkippedSteps(0))
    """Optimizer steps skipped in a row for non-finite gradients; `setup` sets ``optim.max_skipped_steps``."""

    @property
    def context_parallel(self) -> ContextParallel | None:
        return self.layout.context_parallel if self.layout is not None else None

    @property
    def cp_size(self) -> int:
        """Ranks sharing each micro-batch: step code divides replicated losses and all-reduced sums by it."""
        return self.layout.cp_size if self.layout is not None else 1

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.model_source.hf_config, seq_len)


def setup(config: TrainerConfig | SFTConfig, process: str) -> Components:
    world = init_world(config.device, config.parallel.timeout_s, config.gpu_memory_fraction)
    run_dir = RunDir(config.output_dir)
    log_file = run_dir.log_file(process) if config.log.file and world.is_master else None
    logger = setup_logging(process, level=config.log.level if world.is_master else "error", log_file=log_file)
    torch.manual_seed(config.seed)
    if world.is_master:
        write_config(config, run_dir.config_file(process))
    layout = build_layout(world, config.parallel, config.model)
    model, model_source = build_model(
        config.model.name,
        config.model.dtype,
        config.init,
        config.parallel,
        world,
        config.seed,
        lora=config.model.lora,
        adapters=[run.name for run in getattr(config, "runs", [])],
        fp8=config.model.fp8,
        layout=layout,
        seq_len=(config.data.fake.seq_len if config.data.fake is not None else None) or config.seq_len,
    )
    optimizer = build_optimizer(model, config.optim)
    monitor = None
    if world.is_master and not config.bench:
        run_config = config.model_dump(mode="json")
        monitor = build_monitor(config.monitor, output_dir=config.output_dir, process=process, run_config=run_config)
    num_params = sum(p.numel() for p in model.parameters())  # DTensor.numel() is the global size
    logger.info(
        "%s: %s (%.2fM parameters) on %d x %s",
        process,
        config.model.name,
        num_params / 1e6,
        world.world_size,
        perf.device_name(world.device),
    )
    return Components(
        config=config,
        process=process,
        world=world,
        run_dir=run_dir,
        logger=logger,
        model=model,
        model_source=model_source,
        optimizer=optimizer,
        ckpt=CheckpointManager(config.ckpt, run_dir, world, process),
        publisher=build_publisher(config, process, run_dir, world, tokenizer=model_source.tokenizer),
        monitor=monitor,
        peak_flops=perf.peak_flops(world.device, config.perf.peak_tflops),
        loss_scale=loss_scale(model, world),
        layout=layout,
        skipped_steps=SkippedSteps(config.optim.max_skipped_steps),
    )


def resume(c: Components) -> dict[str, Any]:
    """Load ``ckpt.resume_step`` if set; returns its progress (``{"step": 0}`` for a fresh run)."""
    if c.config.ckpt.resume_step is None:
        return {"step": 0}
    return c.ckpt.load(c.config.ckpt.resume_step, c.model, c.optimizer)


def publish_initial(c: Components, step: int, random_init: bool) -> None:
    """Make sure inference can load the weights of ``step`` (the base model dir covers step 0 unless random)."""
    if c.config.bench or not c.config.weights.publish:
        return
    if (step == 0 and random_init) or (step > 0 and not is_stable(c.run_dir.weight_step(step))):
        c.publisher.publish(step, c.model, c.ckpt.protected_steps(), durable=True, serve=False)


def set_grad_sync(model: nn.Module, index: int, count: int) -> None:
    """Reduce-scatter gradients only after the last micro-batch of a step (FSDP accumulates unsharded before)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(index == count - 1)


def optimizer_step(c: Components, step: int, no_loss_tokens: bool = False) -> tuple[float, float]:
    """Clip, set the scheduled learning rate, step (unless the gradients are not finite or the step has no loss token
    on any rank), zero grads. Returns (grad norm, lr)."""
    grad_norm = clip_grad_norm(c.model, c.config.optim.max_norm)
    lr = lr_at(step, c.config.optim.lr, c.config.scheduler, c.config.max_steps)
    set_lr(c.optimizer, lr)
    if c.skipped_steps.admit(
        grad_norm, step, no_loss_tokens=no_loss_tokens
    ):  # the norm is global: every rank decides the same
        c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def perf_metrics(c: Components, num_tokens: float, seq_len: int, compute_s: float) -> dict[str, Any]:
    tokens_per_s = num_tokens / max(compute_s, 1e-9)
    return {
        "throughput/tokens_per_s": tokens_per_s,
        "mfu": perf.mfu(c.flops_per_token(seq_len), tokens_per_s, c.peak_flops, c.world.world_size),
        "peak_memory_gib": perf.peak_memory_gib(c.world.device),
    }


def kept_steps(c: Components, step: int) -> list[int]:
    """Weight steps that must stay on disk once weights ``step`` exist: the checkpoints' and ``step`` if one is due."""
    return c.ckpt.protected_steps() + ([step] if c.ckpt.due(step, c.config.max_steps) else [])


def publish_weights(c: Components, step: int) -> dict[str, float]:
    """Publish the weights after ``step`` optimizer steps as ``weights/step_{step}`` (collective). Returns timings."""
    t0 = time.perf_counter()
    timings = {}
    if not c.config.bench and c.config.weights.publish:
        last = step == c.config.max_steps
        # Nobody samples with the final weights during the run: they go to disk, not to inference.
        durable = last or c.ckpt.due(step, c.config.max_steps)
        published = c.publisher.publish(step, c.model, kept_steps(c, step), durable=durable, serve=not last)
        for key, value in published.items():
            if key.endswith("_s"):
                timings[f"time/publish_{key.removesuffix('_s')}"] = value
    timings["time/publish"] = time.perf_counter() - t0
    return timings


def save_checkpoint(c: Components, step: int, extra_state: dict[str, Any]) -> dict[str, float]:
    """Checkpoint after ``step`` optimizer steps when one is due (collective). Returns its timing."""
    t0 = time.perf_counter()
    c.ckpt.poll()
    if not c.config.bench and c.ckpt.due(step, c.config.max_steps):
        # The LoRA settings let a resume with other ones fail at parse (prime_core.preflight), before the model loads.
        c.ckpt.save(step, c.model, c.optimizer, {**extra_state, "lora": lora_record(c.config.model.lora)})
    return {"time/checkpoint": time.perf_counter() - t0}


def log_step(c: Components, step: int, metrics: dict[str, Any]) -> None:
    """Metrics of the 0-indexed ``step`` to the monitor and the log (rank 0), and to the bench summary."""
    if c.world.is_master:
        if c.monitor is not None:
            c.monitor.log(step, metrics)
        c.logger.info(format_line(step, metrics))
    if c.config.bench:  # only a bench run summarizes its steps; a training run would hold every step's for days
        c.step_times.append(metrics)


def format_line(step: int, m: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key, label, fmt in [
        ("loss/mean", "loss", "{:.4f}"),
        ("val/loss", "val loss", "{:.4f}"),
        ("entropy/mean", "entropy", "{:.4f}"),
        ("mismatch_kl/mean", "mismatch kl", "{:.2e}"),
        ("masked_fraction", "masked", "{:.3f}"),
        ("clipped_fraction", "clipped", "{:.3f}"),
        ("grad_norm", "grad norm", "{:.4f}"),
        ("lr", "lr", "{:.2e}"),
        ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
        ("mfu", "mfu %", "{:.2f}"),
        ("peak_memory_gib", "mem GiB", "{:.2f}"),
        ("time/step", "time s", "{:.2f}"),
    ]:
        if m.get(key) is not None:
            parts.append(f"{label} {fmt.format(m[key])}")
    return " | ".join(parts)


def finish(c: Components) -> None:
    c.ckpt.wait()
    if c.config.bench and c.world.is_master:
        write_bench(c)
    if c.monitor is not None:
        c.monitor.close()


def one_rank_path(c: Components) -> str | None:
    """How a one-rank model computes: ``mixed_precision`` (bf16 working copy; ``mixed_precision+main_grad`` when
    weight gradients are summed in fp32 inside their matmuls), ``fsdp`` or ``plain``; None on more ranks."""
    from prime_models.parallel.mixed_precision import mixed_precision_of

    if c.world.world_size > 1:
        return None
    if isinstance(c.model, FSDPModule):
        return "fsdp"
    mp = mixed_precision_of(c.model)
    if mp is None:
        return "plain"
    return "mixed_precision+main_grad" if mp.main_grad_of else "mixed_precision"


def cuda_graphs_summary(model: nn.Module) -> dict[str, Any] | None:
    """Captures and replays of ``parallel.cuda_graphs`` (None without it): a capture per micro-batch shape and
    packing, a replay per training forward."""
    from prime_models.parallel.cuda_graphs import cuda_graphs_of

    graphs = cuda_graphs_of(model)
    if graphs is None:
        return None
    return {"captures": graphs.captures, "replays": graphs.replays, "last_eager_reason": graphs.last_eager_reason}


def write_bench(c: Components) -> dict[str, Any]:
    """Summarize the bench steps (the first is warmup and skipped when there are more) as JSON."""
    steps = c.step_times[1:] if len(c.step_times) > 1 else c.step_times

    def mean(key: str) -> float | None:
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    fake = c.config.data.fake
    result = {
        "process": c.process,
        "device_name": perf.device_name(c.world.device),
        "world_size": c.world.world_size,
        "model": c.config.model.name,
        "seq_len": fake.seq_len or c.config.seq_len,
        "batch_size": fake.batch_size,
        "micro_batch_size": fake.micro_batch_size,
        "variable_lengths": fake.variable_lengths,
        "max_sample_len": fake.max_sample_len,
        "steps_measured": len(steps),
        "tokens_per_s": mean("throughput/tokens_per_s"),
        "mfu": mean("mfu"),
        "step_time_s": mean("time/step"),
        "peak_memory_gib": max((s["peak_memory_gib"] for s in steps), default=None),
        "memory_plan": c.memory_plan.describe() if c.memory_plan is not None else None,
        "one_rank_path": one_rank_path(c),
        "cuda_graphs": cuda_graphs_summary(c.model),
    }
    path = Path(c.config.bench_file or c.run_dir.root / "bench" / f"{c.process}.json")
    atomic_write_json(path, result)
    print(json.dumps(result, indent=2))
    c.logger.info("bench results written to %s", path)
    return result
