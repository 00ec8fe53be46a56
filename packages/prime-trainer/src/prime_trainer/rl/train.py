"""The RL trainer: step n trains on ``rollouts/step_n`` and publishes ``weights/step_{n+1}``.

Setup (``common.setup``) builds the world, model, optimizer, checkpointing and weight publishing; ``train_step``
is one optimizer step over this rank's micro-batches; ``train`` is the loop.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from prime_core import progress
from prime_core.config.trainer import TrainerConfig
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta

from prime_trainer import common
from prime_trainer.liveness import checkpointing, publishing
from prime_trainer.lora import setup_lora
from prime_trainer.memory import plan_memory
from prime_trainer.model import token_logprobs
from prime_trainer.parallel import pool_cp_micro_batches
from prime_trainer.rl.data import RolloutSource, TensorMicroBatch, fake_micro_batches
from prime_trainer.rl.loss import STAT_KEYS, LossInputs, Objective, build_objective, compute_loss
from prime_trainer.world import all_reduce_sum


def pad_to_common_count(micro_batches: list[MicroBatch], device: torch.device) -> list[MicroBatch]:
    """Every rank must run as many forward/backward passes (FSDP collectives): pad with all-padding batches."""
    count = torch.tensor([len(micro_batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    rows, seq_len = micro_batches[0].shape if micro_batches else (1, 2)
    extra = micro_batches[0].extra_dtypes if micro_batches else None
    return micro_batches + [MicroBatch.empty(rows, seq_len, extra) for _ in range(int(count) - len(micro_batches))]


def forward_backward(
    c: common.Components, objective: Objective, micro_batches: list[TensorMicroBatch], temperature: float
) -> tuple[dict[str, float], tuple[int, int, int]]:
    """Forward/backward every micro-batch (gradients accumulate). Returns the global loss statistics and the global
    (loss tokens, samples, tokens) counts."""
    cfg: TrainerConfig = c.config
    plan_memory(c, micro_batches)
    local = [
        sum(mb.num_loss_tokens for mb in micro_batches),
        sum(mb.num_loss_samples for mb in micro_batches),
        sum(mb.num_tokens for mb in micro_batches),
    ]
    # Under context parallelism every rank of a CP group holds the group's pooled micro-batches and computes their
    # loss on full rows: world-wide sums count everything cp times, and the replicated losses' gradients add up cp times.
    cp = c.cp_size
    num_loss_tokens, num_samples, num_tokens = (int(x) // cp for x in all_reduce_sum(local, c.world.device))
    # Nothing is read back from the device until the step ends (statistics stay there; counts and packing come from
    # the host arrays): a read per micro-batch would wait for its backward and leave the GPU idle while the next
    # forward is launched.
    sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=c.world.device)
    for i, mb in enumerate(micro_batches):
        common.set_grad_sync(c.model, i, len(micro_batches))
        logprobs, entropy = token_logprobs(
            c.model,
            mb.input_ids,
            mb.position_ids,
            temperature=temperature,
            chunk_size=cfg.init.logprob_chunk_size,
            entropy_grad=cfg.loss.entropy_coef > 0,
            multimodal=mb.multimodal,
            context_parallel=c.context_parallel,
            packing=mb.packing,
            # The built-in objectives read log-probs on loss tokens only; a custom one gets every position.
            head_positions=None if cfg.loss.type == "custom" else mb.head_positions,
        )
        segments = (mb.segments, mb.num_loss_samples) if mb.segments is not None else None
        inputs = LossInputs(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.sample_ids, entropy,
                            extra=mb.extra, segments=segments)  # fmt: skip
        loss, stats = compute_loss(objective, cfg.loss, inputs, num_tokens=num_loss_tokens, num_samples=num_samples)
        (loss * (c.loss_scale / cp)).backward()
        sums += stacked(stats)
    totals = dict(zip(STAT_KEYS, all_reduce_sum((sums / cp).tolist(), c.world.device), strict=True))
    return totals, (num_loss_tokens, num_samples, num_tokens)


def stacked(stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """The statistics of `STAT_KEYS` as one float64 vector (one cast when they share a dtype, as the built-in ones do)."""
    values = [stats[k] for k in STAT_KEYS]
    if all(v.dtype == values[0].dtype for v in values):
        return torch.stack(values).to(torch.float64)
    return torch.stack([v.to(torch.float64) for v in values])


def step_metrics(totals: dict[str, float], counts: tuple[int, int, int], grad_norm: float, lr: float) -> dict[str, Any]:
    num_loss_tokens, num_samples, num_tokens = counts
    n = max(num_loss_tokens, 1)
    return {
        "loss/mean": totals["loss"] / n,
        "entropy/mean": totals["entropy"] / n,
        "mismatch_kl/mean": totals["mismatch_kl"] / n,
        "kl/mean": totals["kl"] / n,
        "masked_fraction": totals["masked"] / n,
        "clipped_fraction": totals["clipped"] / n,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": num_tokens,
        "loss_tokens": num_loss_tokens,
        "samples": num_samples,
    }


def train_step(
    c: common.Components, objective: Objective, step: int, micro_batches: list[TensorMicroBatch], temperature: float
) -> dict[str, Any]:
    """Forward/backward every micro-batch, then one optimizer step. Returns the step's metrics (global)."""
    totals, counts = forward_backward(c, objective, micro_batches, temperature)
    grad_norm, lr = common.optimizer_step(c, step, no_loss_tokens=counts[0] == 0)  # counts are global
    return {**step_metrics(totals, counts, grad_norm, lr), "optim/skipped": int(c.skipped_steps.in_a_row > 0)}


def next_micro_batches(
    c: common.Components, rollouts: RolloutSource | None, step: int, seed: int
) -> tuple[RolloutBatchMeta, list[TensorMicroBatch]]:
    """This rank's micro-batches of ``step`` on the device: received (synthesized for fake data), padded to the ranks'
    common count and pooled over the context-parallel group."""
    cfg: TrainerConfig = c.config
    if rollouts is None:
        meta, batches = fake_micro_batches(cfg.data.fake, cfg.seq_len, c.model_source.vocab_size, step, c.world, seed)
    else:
        meta, batches = rollouts.get(step, vocab_size=c.model_source.vocab_size)
    batches = pool_cp_micro_batches(pad_to_common_count(batches, c.world.device), c.layout)
    return meta, [TensorMicroBatch.from_numpy(mb, c.world.device) for mb in batches]


def check_loss_tokens(c: common.Components, step: int, meta: RolloutBatchMeta, metrics: dict[str, Any]) -> None:
    """Warn when the ranks trained on other loss tokens than the orchestrator packed (a lost or stale file)."""
    if meta.global_loss_tokens and meta.global_loss_tokens != metrics["loss_tokens"]:
        c.logger.warning(
            "step %d: orchestrator announced %d loss tokens, ranks received %d",
            step,
            meta.global_loss_tokens,
            metrics["loss_tokens"],
        )


def train(config: TrainerConfig) -> None:
    """One run; several LoRA runs on one base (``config.runs``) train in ``rl.multi_run.train_runs``."""
    with progress.activity("setting up: the process group, the model and the optimizer", kind="setup"):
        c = common.setup(config, "trainer")
    setup_lora(c)
    objective = build_objective(config.loss)
    start = common.resume(c)["step"]
    # A LoRA run's step 0 is the fresh adapter, which inference must load before serving requests that name it.
    common.publish_initial(c, start, c.model_source.random_init or config.model.lora is not None)
    rollouts = None if config.data.fake else RolloutSource(config, c.world)
    c.logger.info("training steps %d..%d with %s loss", start, config.max_steps - 1, config.loss.type)

    for step in range(start, config.max_steps):
        progress.set_step(step)
        t0 = time.perf_counter()
        meta, micro_batches = next_micro_batches(c, rollouts, step, config.seed)
        wait_s = time.perf_counter() - t0
        received_at = time.time()  # wall clock: the loop's timeline lines it up with the orchestrator's

        common.perf.reset_peak_memory(c.world.device)
        t1 = time.perf_counter()
        with progress.activity(f"training step {step}", kind="step"):
            metrics = train_step(c, objective, step, micro_batches, meta.temperature)
        compute_s = time.perf_counter() - t1
        metrics.update(common.perf_metrics(c, metrics["tokens"], meta.seq_len, compute_s))
        metrics.update({"time/step": compute_s, "time/wait": wait_s, "temperature": meta.temperature,
                        "time/received_at": received_at})  # fmt: skip
        check_loss_tokens(c, step, meta, metrics)

        # Step n's update is weights n + 1: published for inference, then checkpointed (both collective), then logged.
        with publishing(c, step + 1):
            metrics.update(common.publish_weights(c, step + 1))
        metrics["time/published_at"] = time.time()
        with checkpointing(c, step + 1):
            metrics.update(common.save_checkpoint(c, step + 1, {"loss": config.loss.type}))
        common.log_step(c, step, metrics)

    if rollouts is not None:
        rollouts.close()
    common.finish(c)
