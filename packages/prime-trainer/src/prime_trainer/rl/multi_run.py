"""Multi-tenant LoRA training: several RL runs share one trainer process and one frozen base model.

Each run (``runs[i]``: adapter name + run directory) has its own orchestrator writing ``rollouts/step_n`` into its
directory, and all of them talk to one inference server that serves every adapter by name. The trainer holds one
adapter per run on the shared base and steps the runs in lock-step: step n reads every run's ``rollouts/step_n``,
runs that run's micro-batches with only its adapter active (so its gradients reach only its adapter), then clips
each adapter's gradient norm separately and takes one AdamW step in which every adapter is its own parameter group
(AdamW is elementwise, so this equals one optimizer per run). Each run's adapter is published to its own
``weights/step_{n+1}`` and its metrics go to its own ``metrics.jsonl``; checkpoints (every adapter and its optimizer
state) live in the trainer's ``output_dir``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prime_core.config.trainer import LoRARunConfig, TrainerConfig
from prime_core.io import is_stable
from prime_core.monitor import build_monitor
from prime_core.run_dir import RunDir
from prime_models.lora import set_active_adapter

from prime_trainer import common
from prime_trainer.lora import (
    AdapterPublisher,
    build_run_optimizer,
    check_base_on_disk,
    clip_adapter_grad_norm,
)
from prime_trainer.optim import lr_at
from prime_trainer.parallel import pool_cp_micro_batches
from prime_trainer.rl.data import RolloutSource, TensorMicroBatch, fake_micro_batches
from prime_trainer.rl.loss import build_objective
from prime_trainer.rl.train import forward_backward, pad_to_common_count, step_metrics


@dataclass
class Run:
    config: LoRARunConfig
    index: int
    lr: float
    run_dir: RunDir
    publisher: AdapterPublisher
    source: RolloutSource | None
    monitor: Any

    @property
    def name(self) -> str:
        return self.config.name


def build_runs(c: common.Components, config: TrainerConfig) -> list[Run]:
    runs = []
    for i, rc in enumerate(config.runs):
        run_dir = RunDir(rc.output_dir)
        source = None
        if config.data.fake is None:
            source = RolloutSource(config.model_copy(update={"output_dir": rc.output_dir}), c.world)
        monitor = None
        if c.world.is_master and not config.bench:
            # W&B: "<name>-<run>-trainer", next to that run's "<name>-<run>-orchestrator".
            wandb = config.monitor.wandb
            if wandb.name:
                wandb = wandb.model_copy(update={"name": f"{wandb.name}-{rc.name}"})
            run_monitor = config.monitor.model_copy(update={"wandb": wandb})
            monitor = build_monitor(run_monitor, output_dir=rc.output_dir, process="trainer",
                                    run_config={**config.model_dump(mode="json"), "run": rc.model_dump(mode="json")})  # fmt: skip
        publisher = AdapterPublisher(
            run_dir, c.world, config.async_level, config.weights.keep_all, adapter=rc.name, base_model=config.model.name
        )
        runs.append(Run(rc, i, rc.lr or config.optim.lr, run_dir, publisher, source, monitor))
    return runs


def publish(c: common.Components, runs: list[Run], step: int, checkpoint_steps: list[int], initial: bool) -> None:
    if c.config.bench or not c.config.weights.publish:
        return
    for run in runs:
        # Initially every run needs its step-0 adapter (inference cannot serve the name before it), and a resumed
        # run the adapter of its resume step unless it is already on disk.
        if initial and step > 0 and is_stable(run.run_dir.weight_step(step)):
            continue
        run.publisher.publish(step, c.model, checkpoint_steps)


def optimizer_step(c: common.Components, runs: list[Run], step: int) -> dict[str, tuple[float, float]]:
    """Per-adapter clipping and learning rate, one AdamW step. Returns {adapter: (grad norm, lr)}."""
    cfg: TrainerConfig = c.config
    out = {}
    for run, group in zip(runs, c.optimizer.param_groups, strict=True):
        grad_norm = clip_adapter_grad_norm(c.model, run.name, cfg.optim.max_norm)
        group["lr"] = lr_at(step, run.lr, cfg.scheduler, cfg.max_steps)
        out[run.name] = (grad_norm, group["lr"])
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return out


def train_runs(config: TrainerConfig) -> None:
    c = common.setup(config, "trainer")
    check_base_on_disk(config, c.source.random_init)
    c.optimizer = build_run_optimizer(c.model, [(r.name, r.lr or config.optim.lr) for r in config.runs], config.optim)
    objective = build_objective(config.loss)
    start = common.resume(c)["step"]
    runs = build_runs(c, config)
    publish(c, runs, start, c.ckpt.protected_steps(), initial=True)
    vocab_size = c.source.hf_config["vocab_size"]
    c.logger.info("multi-tenant: %d runs (%s), steps %d..%d", len(runs), ", ".join(r.name for r in runs), start,
                  config.max_steps - 1)  # fmt: skip

    for step in range(start, config.max_steps):
        t0 = time.perf_counter()
        results = []
        wait_s = 0.0
        for run in runs:
            t_wait = time.perf_counter()
            if run.source is None:
                seed = config.seed + 1000 * (run.index + 1)
                meta, batches = fake_micro_batches(config.data.fake, config.seq_len, vocab_size, step, c.world, seed)
            else:
                meta, batches = run.source.get(step)
            wait_s += time.perf_counter() - t_wait
            batches = pool_cp_micro_batches(pad_to_common_count(batches, c.world.device), c.layout)
            micro_batches = [TensorMicroBatch.from_numpy(mb, c.world.device) for mb in batches]
            set_active_adapter(c.model, run.name)
            totals, counts = forward_backward(c, objective, micro_batches, meta.temperature)
            results.append((totals, counts, meta))
        norms = optimizer_step(c, runs, step)
        compute_s = time.perf_counter() - t0 - wait_s

        done = step + 1
        t_pub = time.perf_counter()
        due = c.ckpt.due(done, config.max_steps)
        publish(c, runs, done, c.ckpt.protected_steps() + ([done] if due else []), initial=False)
        publish_s = time.perf_counter() - t_pub
        c.ckpt.poll()
        if not config.bench and due:
            c.ckpt.save(done, c.model, c.optimizer, {})
        total_tokens = 0
        for run, (totals, counts, meta) in zip(runs, results, strict=True):
            metrics = step_metrics(totals, counts, *norms[run.name])
            metrics.update({"time/step": compute_s, "time/publish": publish_s, "temperature": meta.temperature})
            total_tokens += metrics["tokens"]
            if c.world.is_master:
                if run.monitor is not None:
                    run.monitor.log(step, metrics)
                c.logger.info("[%s] %s", run.name, common.format_line(step, metrics))
        metrics = common.perf_metrics(c, total_tokens, config.seq_len, compute_s)
        metrics.update({"time/step": compute_s, "time/wait": wait_s, "time/publish": publish_s, "tokens": total_tokens})
        if c.world.is_master and c.monitor is not None:
            c.monitor.log(step, metrics)
        c.step_times.append(metrics)

    for run in runs:
        if run.source is not None:
            run.source.close()
        if run.monitor is not None:
            run.monitor.close()
    common.finish(c)
