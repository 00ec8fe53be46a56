"""This rank's micro-batches of a step: from the orchestrator (via the rollout transport) or synthetic."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from prime_core import progress
from prime_core.config import ConfigError
from prime_core.config.trainer import FakeDataConfig, TrainerConfig
from prime_core.io import UnreadableFile
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import (
    MULTIMODAL_FIELDS,
    MicroBatch,
    RolloutBatchMeta,
    check_microbatch,
    nonfinite_fields,
)
from prime_core.transport import make_receiver
from prime_models.layers.attention import RowPacking, row_packing

from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")

# All-padding rows (the tail of a step's last micro-batch, a rank's filler micro-batches) are left out of the forward.
# PRIME_TRIM_EMPTY_ROWS=0 keeps them: the path before, for measuring what they cost.
TRIM_EMPTY_ROWS: bool = os.environ.get("PRIME_TRIM_EMPTY_ROWS", "1") != "0"
# The LM head runs on the positions that predict loss tokens, topped up to a multiple of this many: the fused head's
# compiled chunk kernels then see a few tail lengths, not one per micro-batch. PRIME_HEAD_ON_LOSS_TOKENS=0: every
# position, the path before.
HEAD_POSITIONS_BUCKET = 512
HEAD_ON_LOSS_TOKENS: bool = os.environ.get("PRIME_HEAD_ON_LOSS_TOKENS", "1") != "0"


def head_positions(loss_mask: np.ndarray, bucket: int | None = None) -> np.ndarray | None:
    """Flat indices into ``[R * S]`` of the positions that predict a loss token (t - 1 for a loss token t: the model's
    output at t - 1 is token t's log-prob), in order, topped up with the first other positions to a multiple of
    ``bucket``; None when that is every position."""
    bucket = bucket or HEAD_POSITIONS_BUCKET
    rows, seq = loss_mask.shape
    wanted = np.zeros((rows, seq), np.bool_)
    wanted[:, :-1] = loss_mask[:, 1:]
    flat = wanted.reshape(-1)
    count = int(flat.sum())
    total = min(rows * seq, -(-max(count, 1) // bucket) * bucket)
    if total == rows * seq:
        return None
    flat[np.flatnonzero(~flat)[: total - count]] = True
    return np.flatnonzero(flat)


@dataclass
class TensorMicroBatch:
    """A micro-batch on the training device; every tensor [R, S].

    Everything the step needs to know about it on the host (its counts, where its samples start, each loss token's
    sample) is computed from the host arrays when it is made: reading it back from the device inside the step would
    make the host wait for the GPU once per micro-batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    sample_ids: torch.Tensor
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)
    """Image inputs of a vision-language micro-batch (``pixel_values``, ``image_grid_thw``, ``mrope_position_ids``),
    keyword arguments of the model's forward; empty for text."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """The micro-batch's further per-token arrays [R, S], for the loss (``LossInputs.extra``)."""
    num_tokens: int = 0
    """Real (non-padding) tokens."""
    num_loss_tokens: int = 0
    num_loss_samples: int = 0
    """Samples with a loss token."""
    segments: torch.Tensor | None = None
    """[R, S] dense index (0 .. num_loss_samples - 1) of each loss token's sample, 0 elsewhere (`LossInputs.segments`)."""
    packing: RowPacking | None = None
    """Where the rows' samples start (`prime_models.layers.attention.row_packing`)."""
    head_positions: torch.Tensor | None = None
    """Flat positions the LM head needs for the loss tokens (`head_positions`); None: every position."""
    sent_shape: tuple[int, int] | None = None
    """[R, S] as the packer made it, all-padding rows included: what the memory plan budgets for (a later step's
    micro-batch may fill every row). None: the tensors' shape."""

    @classmethod
    def from_numpy(cls, mb: MicroBatch, device: torch.device) -> TensorMicroBatch:
        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        sent_shape = mb.shape
        if TRIM_EMPTY_ROWS:
            mb = mb.without_empty_rows()

        positions = head_positions(mb.loss_mask) if HEAD_ON_LOSS_TOKENS else None
        loss_samples, inverse = np.unique(mb.sample_ids[mb.loss_mask], return_inverse=True)
        segments = np.zeros(mb.sample_ids.shape, dtype=np.int64)
        segments[mb.loss_mask] = inverse.reshape(-1)
        return cls(
            input_ids=put(mb.input_ids),
            position_ids=put(mb.position_ids),
            loss_mask=put(mb.loss_mask),
            advantages=put(mb.advantages),
            inference_logprobs=put(mb.inference_logprobs),
            sample_ids=put(mb.sample_ids),
            multimodal={name: put(getattr(mb, name)) for name in MULTIMODAL_FIELDS if getattr(mb, name) is not None},
            extra={name: put(arr) for name, arr in mb.extra.items()},
            num_tokens=int((mb.sample_ids >= 0).sum()),
            num_loss_tokens=int(mb.loss_mask.sum()),
            num_loss_samples=len(loss_samples),
            segments=put(segments),
            packing=row_packing(torch.from_numpy(mb.position_ids), device),
            head_positions=None if positions is None else put(positions),
            sent_shape=sent_shape,
        )


class RolloutSource:
    """Receives ``rollouts/step_n`` for this rank through the configured transport."""

    def __init__(self, config: TrainerConfig, world: World):
        self.rank = world.rank
        self.timeout = config.data.wait_timeout_s
        self.seq_len = config.seq_len
        self.cp = config.model.cp
        self.transport = config.transport.type
        self._step = 0
        self.run_dir = RunDir(config.output_dir)
        self.keep = config.data.keep_rollouts if self.transport == "filesystem" else None
        self.receiver = make_receiver(config.transport, self.run_dir, world.rank, on_wait=self._on_wait)

    def _on_wait(self, elapsed: float) -> None:
        logger.info("step %d: rank %d waiting for rollouts for %.0fs", self._step, self.rank, elapsed)

    def get(self, step: int, vocab_size: int | None = None) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
        """This rank's micro-batches of ``step``, checked (`check_microbatch`; with ``vocab_size``, each token id must be
        one of the model's): a batch unfit to train on stops the run in one line naming the step, file, micro-batch
        and field."""
        self._step = step
        where = (
            f"rollouts/step_{step}/rank_{self.rank}"
            if self.transport == "filesystem"
            else f"{self.transport} transport"
        )
        waiting = f"waiting for the orchestrator's rollouts of step {step} ({where})"
        try:
            with progress.activity(waiting, waits_for="orchestrator"):
                received = self.receiver.receive(step, timeout=self.timeout)
        except UnreadableFile as e:
            raise UnreadableFile(f"step {step}: rollouts for rank {self.rank}: {e}") from None
        except TimeoutError as e:
            raise RuntimeError(
                f"step {step}: no rollouts for rank {self.rank} after {self.timeout:.0f}s ({self.transport} "
                f"transport: {e}). Is the orchestrator running with the same --output-dir? "
                f"Raise --data.wait-timeout-s to wait longer."
            ) from None
        meta, micro_batches = received
        if (meta.step, meta.rank) != (step, self.rank):  # a file copied or left over would train as this one
            raise UnreadableFile(
                f"step {step}: rollouts for rank {self.rank} ({where}): the file is of "
                + (f"step {meta.step}" if meta.step != step else f"rank {meta.rank}")
            )
        own = os.environ.get("PRIME_RUN_ID")
        if meta.run_id is not None and own is not None and meta.run_id != own:
            file = self.run_dir.rollout_file(step, self.rank) if self.transport == "filesystem" else where
            raise UnreadableFile(
                f"step {step}: rollouts for rank {self.rank}: {file} was written by launch {meta.run_id!r}, this "
                f"trainer's launch is {own!r} (another run writing to this output directory, or a file an earlier "
                "launch left)"
            )
        if meta.seq_len > self.seq_len:  # the memory plan and the context-parallel split are this trainer's seq_len's
            raise UnreadableFile(
                f"step {step}: rollouts for rank {self.rank} ({where}): rows of {meta.seq_len} tokens, longer than this "
                f"trainer's seq_len of {self.seq_len} (the orchestrator's seq_len must not exceed it)"
            )
        if self.cp > 1 and meta.seq_len % (2 * self.cp):  # else a ValueError traceback inside the forward
            raise UnreadableFile(
                f"step {step}: rollouts for rank {self.rank} ({where}): rows of {meta.seq_len} tokens do not split into "
                f"2 * model.cp = {2 * self.cp} equal chunks (context parallelism)"
            )
        for i, mb in enumerate(micro_batches):
            if (why := check_microbatch(mb, meta.seq_len, vocab_size)) is not None:
                raise UnreadableFile(f"step {step}: rollouts for rank {self.rank} ({where}): micro-batch {i} {why}")
            for name, count in nonfinite_fields(mb).items():
                logger.warning(
                    "step %d: rollouts for rank %d (%s): micro-batch %d: %s holds %d non-finite value(s) on loss "
                    "tokens (a step whose gradient is not finite skips its optimizer step)",
                    step, self.rank, where, i, name, count,
                )  # fmt: skip
        self._drop_consumed(step)
        return received

    def _drop_consumed(self, step: int) -> None:
        """Delete this rank's files of steps ``keep`` or more behind ``step``; the rank that deletes a step's last file
        removes its directory. Every older step goes too (a resumed run's leftovers from before its checkpoint)."""
        if self.keep is None:
            return
        for old in self.run_dir.rollout_steps():
            if old > step - self.keep:
                break
            self.run_dir.rollout_file(old, self.rank).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another rank's file is still there
                self.run_dir.rollout_step(old).rmdir()

    def close(self) -> None:
        self.receiver.close()


def fake_micro_batches(
    config: FakeDataConfig, seq_len: int, vocab_size: int, step: int, world: World, seed: int
) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
    """Deterministic synthetic micro-batches for (step, rank): prompt tokens then trained completion tokens."""
    rows_per_rank, rest = divmod(config.batch_size, world.world_size)
    if rest or rows_per_rank % config.micro_batch_size:
        raise ConfigError(
            f"data.fake.batch_size={config.batch_size} must split into {world.world_size} ranks x "
            f"micro_batch_size={config.micro_batch_size}"
        )
    rng = np.random.default_rng([seed, step, world.rank])
    seq_len = config.seq_len or seq_len
    micro_batches = []
    sample = world.rank * rows_per_rank * seq_len  # globally unique sample ids
    longest = min(config.max_sample_len or seq_len, seq_len)
    for _ in range(rows_per_rank // config.micro_batch_size):
        mb = MicroBatch.empty(config.micro_batch_size, seq_len)
        for row in range(config.micro_batch_size):
            pos = 0
            while pos < seq_len:
                length = int(rng.integers(2, longest + 1)) if config.variable_lengths else seq_len
                length = min(length, seq_len - pos)
                span = slice(pos, pos + length)
                mb.input_ids[row, span] = rng.integers(0, vocab_size, length)
                mb.position_ids[row, span] = np.arange(length)
                mb.sample_ids[row, span] = sample
                completion = slice(pos + max(length // 2, 1), pos + length)
                mb.loss_mask[row, completion] = True
                mb.advantages[row, completion] = rng.standard_normal()
                # Near a random-init model's log-probs, so ratios stay O(1) as in a real on-policy run.
                n = completion.stop - completion.start
                mb.inference_logprobs[row, completion] = -np.log(vocab_size) + 0.05 * rng.standard_normal(n)
                pos += length
                sample += 1
        micro_batches.append(mb)
    meta = RolloutBatchMeta(step=step, rank=world.rank, num_micro_batches=len(micro_batches), seq_len=seq_len)
    return meta, micro_batches
