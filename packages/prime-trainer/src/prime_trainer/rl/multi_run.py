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

from prime_core import progress
from prime_core.config.trainer import LoRARunConfig, TrainerConfig
from prime_core.io import is_stable
from prime_core.monitor import Monitor, build_monitor
from prime_core.run_dir import RunDir
from prime_models.lora import set_active_adapter

from prime_trainer import common
from prime_trainer.liveness import checkpointing, publishing
from prime_trainer.lora import build_run_optimizer, check_base_on_disk, clip_adapter_grad_norm
from prime_trainer.optim import SkippedSteps, lr_at
from prime_trainer.rl.data import RolloutSource
from prime_trainer.rl.loss import build_objective
from prime_trainer.rl.train import forward_backward, next_micro_batches, step_metrics
from prime_trainer.weights import WeightPublisher, build_publisher


@dataclass
class Run:
    config: LoRARunConfig
    index: int
    lr: float
    run_dir: RunDir
    publisher: WeightPublisher
    rollouts: RolloutSource | None
    """The run's rollouts; None for fake data."""
    monitor: Monitor | None
    skipped_steps: SkippedSteps

    @property
    def name(self) -> str:
        return self.config.name

    def fake_seed(self, seed: int) -> int:
        """Each run's synthetic data differs from the others'."""
        return seed + 1000 * (self.index + 1)


def build_runs(c: common.Components, config: TrainerConfig) -> list[Run]:
    runs = []
    for i, rc in enumerate(config.runs):
        run_dir = RunDir(rc.output_dir)
        rollouts = None
        if config.data.fake is None:
            rollouts = RolloutSource(config.model_copy(update={"output_dir": rc.output_dir}), c.world)
        monitor = None
        if c.world.is_master and not config.bench:
            # W&B: "<name>-<run>-trainer", next to that run's "<name>-<run>-orchestrator".
            wandb = config.monitor.wandb
            if wandb.name:
                wandb = wandb.model_copy(update={"name": f"{wandb.name}-{rc.name}"})
            run_monitor = config.monitor.model_copy(update={"wandb": wandb})
            monitor = build_monitor(run_monitor, output_dir=rc.output_dir, process="trainer",
                                    run_config={**config.model_dump(mode="json"), "run": rc.model_dump(mode="json")})  # fmt: skip
        publisher = build_publisher(config, "trainer", run_dir, c.world, tokenizer=config.model.name, adapter=rc.name)
        skipped = SkippedSteps(config.optim.max_skipped_steps, what=f" of run {rc.name}")
        runs.append(Run(rc, i, rc.lr or config.optim.lr, run_dir, publisher, rollouts, monitor, skipped))
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
    """Per-adapter clipping and learning rate, one AdamW step. Returns {adapter: (grad norm, lr)}. An adapter whose
    gradients are not finite sits the step out (its gradients dropped, so AdamW leaves it and its moments as they
    were); the other runs train."""
    cfg: TrainerConfig = c.config
    out = {}
    for run, group in zip(runs, c.optimizer.param_groups, strict=True):
        grad_norm = clip_adapter_grad_norm(c.model, run.name, cfg.optim.max_norm)
        group["lr"] = lr_at(step, run.lr, cfg.scheduler, cfg.max_steps)
        out[run.name] = (grad_norm, group["lr"])
        if not run.skipped_steps.admit(grad_norm, step):
            for p in group["params"]:
                p.grad = None
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return out


def log_runs(
    c: common.Components, runs: list[Run], step: int, results: list[tuple], norms: dict, timings: dict[str, float]
) -> int:
    """Each run's metrics to its own monitor and the log (rank 0). Returns the tokens of all runs."""
    total_tokens = 0
    for run, (totals, counts, meta) in zip(runs, results, strict=True):
        metrics = {
            **step_metrics(totals, counts, *norms[run.name]),
            "optim/skipped": int(run.skipped_steps.in_a_row > 0),
        }
        metrics.update({**timings, "temperature": meta.temperature})
        total_tokens += metrics["tokens"]
        if c.world.is_master:
            if run.monitor is not None:
                run.monitor.log(step, metrics)
            c.logger.info("[%s] %s", run.name, common.format_line(step, metrics))
    return total_tokens


def train_runs(config: TrainerConfig) -> None:
    c = common.setup(config, "trainer")
    check_base_on_disk(config, c.model_source.random_init)
    c.optimizer = build_run_optimizer(c.model, [(r.name, r.lr or config.optim.lr) for r in config.runs], config.optim)
    objective = build_objective(config.loss)
    start = common.resume(c)["step"]
    runs = build_runs(c, config)
    c.ckpt.run_dirs = [run.run_dir for run in runs]
    publish(c, runs, start, c.ckpt.protected_steps(), initial=True)
    c.logger.info("multi-tenant: %d runs (%s), steps %d..%d", len(runs), ", ".join(r.name for r in runs), start,
                  config.max_steps - 1)  # fmt: skip

    for step in range(start, config.max_steps):
        t0 = time.perf_counter()
        results, wait_s = [], 0.0
        for run in runs:
            t_wait = time.perf_counter()
            meta, micro_batches = next_micro_batches(c, run.rollouts, step, run.fake_seed(config.seed))
            wait_s += time.perf_counter() - t_wait
            set_active_adapter(c.model, run.name)
            with progress.activity(f"training step {step} of run {run.name}", kind="step"):
                results.append((*forward_backward(c, objective, micro_batches, meta.temperature), meta))
        norms = optimizer_step(c, runs, step)
        compute_s = time.perf_counter() - t0 - wait_s

        # Step n's adapters are every run's weights n + 1: published, then checkpointed together, then logged.
        t_pub = time.perf_counter()
        with publishing(c, step + 1):
            publish(c, runs, step + 1, common.kept_steps(c, step + 1), initial=False)
        timings = {"time/step": compute_s, "time/publish": time.perf_counter() - t_pub}
        with checkpointing(c, step + 1):
            timings.update(common.save_checkpoint(c, step + 1, {}))
        total_tokens = log_runs(c, runs, step, results, norms, timings)
        metrics = common.perf_metrics(c, total_tokens, config.seq_len, compute_s)
        common.log_step(c, step, {**metrics, **timings, "time/wait": wait_s, "tokens": total_tokens})

    for run in runs:
        if run.rollouts is not None:
            run.rollouts.close()
        if run.monitor is not None:
            run.monitor.close()
    common.finish(c)
