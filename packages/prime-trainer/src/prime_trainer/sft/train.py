"""The SFT trainer: masked next-token NLL over packed chat rows, normalized by the step's global trained-token count.

Setup (``common.setup`` + the dataset), ``sft_step`` (one optimizer step), ``evaluate`` (validation loss), ``train``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch
from prime_core.config import ConfigError
from prime_core.config.trainer import SFTConfig
from prime_core.schemas.microbatch import MicroBatch
from prime_core.vision import VisionSpec

from prime_trainer import common
from prime_trainer.lora import setup_lora
from prime_trainer.memory import plan_memory
from prime_trainer.model import resolve_source, token_logprobs
from prime_trainer.parallel import pool_cp_micro_batches
from prime_trainer.rl.data import TensorMicroBatch, fake_micro_batches
from prime_trainer.sft.data import PackedData, Sample, build_samples, eval_batches, load_rows, load_tokenizer
from prime_trainer.sft.rows import to_messages, where_of
from prime_trainer.world import all_reduce_sum

logger = logging.getLogger("prime.sft")


def nll_sum(c: common.Components, mb: TensorMicroBatch) -> torch.Tensor:
    logprobs, _ = token_logprobs(
        c.model,
        mb.input_ids,
        mb.position_ids,
        temperature=1.0,
        chunk_size=c.config.init.logprob_chunk_size,
        entropy_grad=False,
        return_entropy=False,
        multimodal=mb.multimodal,
        context_parallel=c.context_parallel,
        packing=mb.packing,
        head_positions=mb.head_positions,
    )
    return -(logprobs * mb.loss_mask).sum()


def sft_step(c: common.Components, step: int, micro_batches: list[TensorMicroBatch]) -> dict[str, Any]:
    plan_memory(c, micro_batches)
    local = [sum(mb.num_loss_tokens for mb in micro_batches), sum(mb.num_tokens for mb in micro_batches)]
    # Under context parallelism the ranks of a CP group share pooled micro-batches (see prime_trainer.parallel): sums
    # over the world count them cp times, and the replicated losses' gradients add up cp times.
    cp = c.cp_size
    num_loss_tokens, num_tokens = (int(x) // cp for x in all_reduce_sum(local, c.world.device))
    # The loss stays on the device until the step ends: reading it per micro-batch would wait for each backward.
    total = torch.zeros((), dtype=torch.float64, device=c.world.device)
    for i, mb in enumerate(micro_batches):
        common.set_grad_sync(c.model, i, len(micro_batches))
        loss = nll_sum(c, mb) / max(num_loss_tokens, 1)
        (loss * (c.loss_scale / cp)).backward()
        total += loss.detach()
    grad_norm, lr = common.optimizer_step(c, step)
    (loss_mean,) = all_reduce_sum([float(total) / cp], c.world.device)
    return {
        "loss/mean": loss_mean,
        "grad_norm": grad_norm,
        "optim/skipped": int(c.skipped_steps.in_a_row > 0),
        "lr": lr,
        "tokens": num_tokens,
        "loss_tokens": num_loss_tokens,
    }


@torch.no_grad()
def evaluate(c: common.Components, batches: list[MicroBatch]) -> float:
    total, count = 0.0, 0
    # CP ranks pool their batches; the totals then count each batch cp times, which the ratio cancels.
    for mb in pool_cp_micro_batches(batches, c.layout):
        t = TensorMicroBatch.from_numpy(mb, c.world.device)
        total += float(nll_sum(c, t))
        count += t.num_loss_tokens
    total, count = all_reduce_sum([total, count], c.world.device)
    return total / max(count, 1)


def read_rows(config: SFTConfig) -> tuple[list, list]:
    """Training and validation rows, each row's shape checked (``to_messages``). ``train`` reads them before it
    builds the model, so a bad file fails in seconds rather than after a large model has loaded."""
    rows = load_rows(config.data.path, config.data.split)
    val_rows: list = []
    if config.val.path is not None:
        val_rows = load_rows(config.val.path, config.data.split)
    elif config.val.fraction > 0:
        order = np.random.default_rng(config.seed).permutation(len(rows))
        num_val = max(1, int(round(len(rows) * config.val.fraction)))
        if num_val >= len(rows):
            raise ConfigError(
                f"data.path has {len(rows)} rows: val.fraction={config.val.fraction} leaves none to train on"
            )
        val_rows, rows = rows.subset(order[:num_val]), rows.subset(order[num_val:])
    for some in (rows, val_rows):
        for i, row in enumerate(some):
            to_messages(row, where_of(some, i))
    return rows, val_rows


def tokenize(
    config: SFTConfig,
    tokenizer_name: str,
    vision: VisionSpec | None = None,
    vocab_size: int | None = None,
    rows: tuple[list, list] | None = None,
) -> tuple[list[Sample], list[Sample] | None]:
    """Training and validation samples (None without validation); data with no trained token is a ``ConfigError``
    naming the data and why (`build_samples`). ``rows``: ``read_rows``'s, read already."""
    tokenizer = load_tokenizer(tokenizer_name, config.data.chat_template)
    rows, val_rows = rows if rows is not None else read_rows(config)
    args = (tokenizer, config.data.loss_mask, config.seq_len, vision)
    samples = build_samples(rows, *args, source="data.path", vocab_size=vocab_size)
    if not val_rows:
        return samples, None
    source = "val.path" if config.val.path is not None else "data.path (validation rows)"
    return samples, build_samples(val_rows, *args, source=source, vocab_size=vocab_size)


def tokenize_before_model(config: SFTConfig) -> tuple[tuple[list[Sample], list[Sample] | None] | None, list]:
    """The samples, made before the model is built (None with fake data): data with no trained token (a
    ``data.loss_mask`` that trains no role of the data, every row's answer past ``seq_len``) was one line only after
    the model was built, minutes on a GPU host. Its warnings are held (logging is set up with the model), to be logged
    by `log_held`."""
    if config.data.fake is not None:
        return None, []
    rows = read_rows(config)
    held: list[logging.LogRecord] = []
    hold = logging.Handler()
    hold.emit = held.append  # type: ignore[method-assign]
    prime = logging.getLogger("prime")
    prime.addHandler(hold)
    propagate, prime.propagate = prime.propagate, False
    try:
        _, source = resolve_source(config.model.name, config.init)  # the model's config.json; its weights load later
        vision = VisionSpec.from_model_dir(source.model_dir)
        return tokenize(config, source.tokenizer, vision, source.vocab_size, rows), held
    finally:
        prime.removeHandler(hold)
        prime.propagate = propagate


def log_held(held: list[logging.LogRecord]) -> None:
    """The data's held warnings, at this rank's level; the model's come again when it is built."""
    for record in held:
        found = logging.getLogger(record.name)
        if record.name.startswith("prime.sft") and found.isEnabledFor(record.levelno):
            found.handle(record)


def build_data(
    config: SFTConfig,
    tokenizer_name: str,
    world,
    vision: VisionSpec | None = None,
    vocab_size: int | None = None,
    rows: tuple[list, list] | None = None,
    samples: tuple[list[Sample], list[Sample] | None] | None = None,
) -> tuple[PackedData | None, list | None]:
    """Training rows (None with fake data) and this rank's validation batches (None without validation).

    ``vision``: image preprocessing and token ids of a vision-language model (rows may then hold images).
    ``vocab_size``: the model's; a row with a larger token id is refused. ``rows``: ``read_rows``'s, read already;
    ``samples``: `tokenize`'s, made already.
    """
    if config.data.fake is not None:
        return None, None
    samples, val_samples = samples or tokenize(config, tokenizer_name, vision, vocab_size, rows)
    data = PackedData(
        samples,
        config.seq_len,
        config.data.batch_size,
        config.data.micro_batch_size,
        config.data.shuffle,
        config.seed,
        vision,
    )
    num_rows = len(data.rows(0))
    if num_rows < config.data.batch_size:
        logger.warning(
            "data.path packs into %d rows of seq_len=%d, fewer than data.batch_size=%d: every step repeats rows",
            num_rows,
            config.seq_len,
            config.data.batch_size,
        )
    val = None
    if val_samples is not None:
        val = eval_batches(
            val_samples,
            config.seq_len,
            config.data.micro_batch_size,
            world.rank,
            world.world_size,
            config.val.max_rows,
            vision,
        )
    return data, val


def train(config: SFTConfig) -> None:
    samples, held = tokenize_before_model(config)
    c = common.setup(config, "sft")
    log_held(held)
    setup_lora(c)
    vision = VisionSpec.from_model_dir(c.model_source.model_dir)
    data, val = build_data(config, c.model_source.tokenizer, c.world, vision, c.model_source.vocab_size, None, samples)
    progress = common.resume(c)
    start = progress["step"]
    if data is not None and "data" in progress:
        data.load_state(progress["data"])
    vocab_size = c.model_source.vocab_size
    if data is not None:
        c.logger.info("%d training samples, %d validation batches", len(data.samples), len(val or []))
    if val is not None:
        val_loss = evaluate(c, val)
        c.logger.info("step %d | val loss %.4f (before training)", start, val_loss)
        if c.monitor is not None:
            c.monitor.log(start, {"val/loss": val_loss, "val/perplexity": math.exp(min(val_loss, 20.0))})

    for step in range(start, config.max_steps):
        if data is None:
            fake = config.data.fake
            _, batches = fake_micro_batches(fake, config.seq_len, vocab_size, step, c.world, config.seed)
            seq_len = fake.seq_len or config.seq_len
        else:
            batches = data.next_batch(c.world.rank, c.world.world_size)
            seq_len = config.seq_len
        batches = pool_cp_micro_batches(batches, c.layout)
        micro_batches = [TensorMicroBatch.from_numpy(mb, c.world.device) for mb in batches]

        common.perf.reset_peak_memory(c.world.device)
        t0 = time.perf_counter()
        metrics = sft_step(c, step, micro_batches)
        compute_s = time.perf_counter() - t0
        metrics.update(common.perf_metrics(c, metrics["tokens"], seq_len, compute_s))
        metrics["time/step"] = compute_s
        done = step + 1
        if val is not None and (done % config.val.interval == 0 or done == config.max_steps):
            metrics["val/loss"] = evaluate(c, val)
            metrics["val/perplexity"] = math.exp(min(metrics["val/loss"], 20.0))
        if done == config.max_steps or (config.weights_interval is not None and done % config.weights_interval == 0):
            metrics.update(common.publish_weights(c, done))
        metrics.update(common.save_checkpoint(c, done, {"data": data.state()} if data is not None else {}))
        common.log_step(c, step, metrics)

    common.finish(c)
