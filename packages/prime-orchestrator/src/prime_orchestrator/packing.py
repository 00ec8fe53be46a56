"""Samples -> per-rank micro-batches.

1. Truncate or drop samples longer than ``seq_len``.
2. Balance samples across trainer ranks by token count (longest first onto the lightest rank), so the
   ranks' token totals differ by at most one sample's length.
3. On each rank, pack samples into rows of ``seq_len`` with first-fit-decreasing (no sample is split).
4. Group rows into micro-batches of ``micro_batch_rows``; every rank gets the same number of
   micro-batches (short ranks are padded with ``MicroBatch.empty``).

Per-token arrays of a sample (``Sample.extra``, e.g. a teacher's log-probs) land in the micro-batch's ``extra``
under the same name, aligned with the sample's tokens and 0 elsewhere; every micro-batch of the step carries every
name, so the loss finds it on each rank (``LossInputs.extra``).

Samples with images (vision-language models) carry their image sources; packing patchifies them into the
micro-batch's ``pixel_values`` / ``image_grid_thw`` and writes per-sample 3D positions (``mrope_position_ids``,
restarting at every sample). Truncation never cuts an image: a sample whose cut falls inside (or before) an image's
placeholders is dropped, and so is a sample whose sampled tokens hold an image placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta, stack_rows
from prime_core.vision import VisionSpec, mrope_positions


@dataclass
class Sample:
    """One trainable sequence: prompt + completion (+ env turns) tokens of one rollout."""

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    advantage: float | list[float]
    """The sample's advantage, or one per token (on-policy distillation)."""
    weight_step: int
    env: str = ""
    reward: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    """Per-token arrays by name, one value per token of ``token_ids``: the micro-batch's ``extra`` (see above)."""
    images: list[Any] = field(default_factory=list)
    """Image sources (data: URLs) of the sample's placeholder runs, in order."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PackResult:
    micro_batches: list[list[MicroBatch]]  # [rank][i]
    metas: list[RolloutBatchMeta]
    num_truncated: int
    num_dropped: int


def _image_cut(s: Sample, seq_len: int, vision: VisionSpec | None) -> bool:
    """Whether truncating ``s`` to ``seq_len`` would cut into an image's placeholders."""
    if not s.images or vision is None:
        return False
    return (
        vision.image_token_id in s.token_ids[seq_len - 1 :] or s.token_ids[seq_len - 1] == vision.vision_start_token_id
    )


def _sampled_placeholder(s: Sample, vision: VisionSpec | None) -> bool:
    """Whether the model sampled an image placeholder token: an image slot with no image, which the trainer's vision
    model cannot fill (a poorly trained model can sample any token)."""
    if vision is None:
        return False
    return any(m and t == vision.image_token_id for t, m in zip(s.token_ids, s.loss_mask, strict=True))


def fit_to_seq_len(
    samples: list[Sample], seq_len: int, mode: str, vision: VisionSpec | None = None
) -> tuple[list[Sample], int, int]:
    """Apply the long-sample policy; returns (kept samples, truncated count, dropped count)."""
    kept, truncated, dropped = [], 0, 0
    for s in samples:
        if _sampled_placeholder(s, vision):
            dropped += 1
        elif len(s) <= seq_len:
            kept.append(s)
        elif mode == "drop" or _image_cut(s, seq_len, vision):
            dropped += 1
        else:
            truncated += 1
            kept.append(
                Sample(
                    s.token_ids[:seq_len],
                    s.loss_mask[:seq_len],
                    s.logprobs[:seq_len],
                    s.advantage if isinstance(s.advantage, float) else s.advantage[:seq_len],
                    s.weight_step,
                    s.env,
                    s.reward,
                    {name: np.asarray(v)[:seq_len] for name, v in s.extra.items()},
                    s.images,
                )
            )
    return kept, truncated, dropped


def seq_len_too_short(samples: list[Sample], seq_len: int) -> str | None:
    """Why no sample of a step can train (every trained token lies beyond ``seq_len``: the prompts alone fill it),
    or None. Truncation would keep only prompt tokens, and the run would go on training on nothing."""
    firsts = [next((i for i, m in enumerate(s.loss_mask) if m), None) for s in samples]
    trained = [f for f in firsts if f is not None]
    if not trained or min(trained) < seq_len:
        return None
    return (
        f"every prompt fills seq_len ({seq_len}) (the shortest is {min(trained)} tokens): no sample keeps a trained "
        "token; raise seq_len"
    )


def balance_across_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Indices per rank; greedy longest-processing-time: max-min token totals <= the longest sample."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * num_ranks
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        r = min(range(num_ranks), key=lambda k: (loads[k], k))
        assignment[r].append(i)
        loads[r] += lengths[i]
    return assignment


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices with total length <= capacity; each index in exactly one bin."""
    bins: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"sample of {lengths[i]} tokens does not fit a row of {capacity}")
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(capacity - lengths[i])
    return bins


def extra_dtypes(samples: list[Sample]) -> dict[str, np.dtype]:
    """The step's ``extra`` arrays: every name any sample has, float64 stored as float32 (like the log-probs)."""
    dtypes: dict[str, np.dtype] = {}
    for s in samples:
        for name, value in s.extra.items():
            arr = np.asarray(value)
            if arr.shape != (len(s),):
                raise ValueError(f"sample extra {name!r} has shape {arr.shape}, expected ({len(s)},): one per token")
            dtype = np.dtype(np.float32) if arr.dtype == np.float64 else arr.dtype
            dtypes[name] = np.result_type(dtypes.get(name, dtype), dtype)
    return dtypes


def _row(
    samples: list[Sample],
    local_ids: list[int],
    seq_len: int,
    vision: VisionSpec | None = None,
    extra: dict[str, np.dtype] | None = None,
) -> MicroBatch:
    extra = extra or {}
    extra_row = {name: np.zeros(seq_len, dtype) for name, dtype in extra.items()}
    row = {
        "input_ids": np.zeros(seq_len, np.int64),
        "position_ids": np.zeros(seq_len, np.int64),
        "loss_mask": np.zeros(seq_len, np.bool_),
        "advantages": np.zeros(seq_len, np.float32),
        "inference_logprobs": np.zeros(seq_len, np.float32),
        "sample_ids": np.full(seq_len, -1, np.int64),
    }
    pos = 0
    images, mrope_spans = [], []
    for s, sid in zip(samples, local_ids, strict=True):
        n = len(s)
        sl = slice(pos, pos + n)
        if s.images:
            if vision is None:
                raise ValueError("a sample has images but the model has no vision config (vision_config)")
            images += s.images
            mrope_spans.append((sl, s))
        mask = np.asarray(s.loss_mask, np.bool_)
        row["input_ids"][sl] = s.token_ids
        row["position_ids"][sl] = np.arange(n)
        row["loss_mask"][sl] = mask
        row["advantages"][sl] = np.where(mask, s.advantage, 0.0)
        row["inference_logprobs"][sl] = np.where(mask, np.asarray(s.logprobs, np.float32), 0.0)
        row["sample_ids"][sl] = sid
        for name, value in s.extra.items():
            extra_row[name][sl] = value
        pos += n
    row["position_ids"][pos:] = np.arange(seq_len - pos)  # padding counts from 0 as its own segment
    mb = MicroBatch(**{k: v[None] for k, v in row.items()}, extra={k: v[None] for k, v in extra_row.items()})
    if images:
        mb.pixel_values, mb.image_grid_thw = vision.processor.process_many(images)
        mrope = np.broadcast_to(mb.position_ids, (3, 1, seq_len)).copy()
        k = 0
        for sl, s in mrope_spans:
            grids = mb.image_grid_thw[k : k + len(s.images)]
            mrope[:, 0, sl] = mrope_positions(s.token_ids, vision.image_token_id, grids, vision.processor.merge_size)
            k += len(s.images)
        mb.mrope_position_ids = mrope
    return mb


def pack(
    samples: list[Sample],
    *,
    step: int,
    seq_len: int,
    num_ranks: int,
    micro_batch_rows: int,
    temperature: float,
    long_samples: str = "truncate",
    extras: dict | None = None,
    vision: VisionSpec | None = None,
    run_id: str | None = None,
) -> PackResult:
    """Pack one step's samples for every trainer rank (see the module docstring); ``run_id`` is the launch's, which
    the trainer checks."""
    extra = extra_dtypes(samples)
    samples, num_truncated, num_dropped = fit_to_seq_len(samples, seq_len, long_samples, vision)
    per_rank = balance_across_ranks([len(s) for s in samples], num_ranks)
    global_loss_tokens = sum(int(sum(s.loss_mask)) for s in samples)
    rank_batches: list[list[MicroBatch]] = []
    rank_weight_steps: list[list[int]] = []
    for idxs in per_rank:
        local = [samples[i] for i in sorted(idxs)]
        rows = []
        for b in first_fit_decreasing([len(s) for s in local], seq_len):
            b = sorted(b)
            rows.append(_row([local[i] for i in b], b, seq_len, vision, extra))
        mbs = []
        for start in range(0, len(rows), micro_batch_rows):
            chunk = rows[start : start + micro_batch_rows]
            while len(chunk) < micro_batch_rows:
                chunk.append(MicroBatch.empty(1, seq_len, extra))
            mbs.append(stack_rows(chunk))
        rank_batches.append(mbs)
        rank_weight_steps.append([s.weight_step for s in local])
    num_mb = max(1, max(len(m) for m in rank_batches))
    for mbs in rank_batches:
        while len(mbs) < num_mb:
            mbs.append(MicroBatch.empty(micro_batch_rows, seq_len, extra))
    metas = [
        RolloutBatchMeta(
            step=step,
            rank=r,
            num_micro_batches=num_mb,
            seq_len=seq_len,
            temperature=temperature,
            global_loss_tokens=global_loss_tokens,
            global_num_samples=len(samples),
            weight_steps=rank_weight_steps[r],
            extras=dict(extras or {}),
            run_id=run_id,
        )
        for r in range(num_ranks)
    ]
    return PackResult(rank_batches, metas, num_truncated, num_dropped)
