"""SFT data: load chat rows, render them with the chat template, mask by role, pack into fixed-length rows.

Row formats: ``messages`` (a whole conversation) wins over ``prompt`` + ``completion`` (strings become a user and an
assistant message; lists are messages). ``tools`` (a list or a JSON string) is passed to the chat template.

Loss masks come from rendering every prefix of the conversation: the text added by message k is attributed to k's
role. This needs the template's prefix property (rendering messages[:k] is a prefix of rendering messages[:k+1]);
templates that rewrite earlier turns (e.g. strip past reasoning) are refused with the first offending message.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prime_core.config.trainer import LossMaskConfig
from prime_core.schemas.microbatch import MicroBatch

logger = logging.getLogger("prime.sft")

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


# ---------------------------------------------------------------- loading


def load_rows(path: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a .jsonl/.json/.parquet file, a directory of such files, or a ``datasets`` save_to_disk directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"dataset {path!r} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
        return _load_hf_disk(p, split)
    files = sorted(f for f in p.iterdir() if f.suffix in _FILE_SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"no {'/'.join(_FILE_SUFFIXES)} files in {path!r}")
    rows: list[dict[str, Any]] = []
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(f).to_pylist())
        elif f.suffix == ".jsonl":
            rows.extend(json.loads(line) for line in f.read_text().splitlines() if line.strip())
        elif f.suffix == ".json":
            data = json.loads(f.read_text())
            rows.extend(data if isinstance(data, list) else [data])
        else:
            raise ValueError(f"{f}: unsupported dataset file type (use {', '.join(_FILE_SUFFIXES)})")
    return rows


def _load_hf_disk(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{path} is a `datasets` save_to_disk directory: reading it needs the `datasets` package "
            "(pip install datasets), or export it to .jsonl/.parquet"
        ) from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    return ds.to_list()


def to_messages(row: dict[str, Any], index: int) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """A row's conversation and tools."""
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    if row.get("messages") is not None:
        messages = list(row["messages"])
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
        messages = prompt + completion
    else:
        raise ValueError(f"row {index}: needs `messages`, or `prompt` and `completion` (has {sorted(row)})")
    messages = [_clean_message(m) for m in messages]
    return messages, tools or None


def _clean_message(message: dict[str, Any]) -> dict[str, Any]:
    """Drop null fields (columnar formats fill absent keys with None); parse JSON-string tool-call arguments."""
    out = {k: v for k, v in message.items() if v is not None}
    for call in out.get("tool_calls") or []:
        fn = call.get("function", {})
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(fn["arguments"])
    return out


# ---------------------------------------------------------------- tokenization with role masks


class PrefixPropertyError(ValueError):
    pass


def render(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None, roles: LossMaskConfig, index: int = 0
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained (by its message's role).

    The role header the template adds before an assistant message (its generation prompt) is never trained.
    """
    spans: list[tuple[int, int, bool]] = []  # character spans of the full text and whether they are trained
    prev = ""
    for k, message in enumerate(messages):
        text = render(tokenizer, messages[: k + 1], tools)
        if not text.startswith(prev):
            at = next(
                (i for i, (a, b) in enumerate(zip(prev, text, strict=False)) if a != b), min(len(prev), len(text))
            )
            raise PrefixPropertyError(
                f"row {index}: the chat template lacks the prefix property: adding message {k} "
                f"(role {message.get('role')!r}) changes how messages[:{k}] render (first difference at character "
                f"{at}: {prev[at : at + 40]!r} became {text[at : at + 40]!r}). Templates that rewrite earlier turns (e.g. "
                "strip past reasoning) cannot be masked by role; use a template that keeps history verbatim "
                "(--data.chat-template)."
            )
        role = message.get("role", "")
        trained = bool(getattr(roles, role, False))
        start = len(prev)
        if role == "assistant" and k > 0:
            header = render(tokenizer, messages[:k], tools, add_generation_prompt=True)
            if header.startswith(prev) and text.startswith(header):
                spans.append((start, len(header), False))
                start = len(header)
        spans.append((start, len(text), trained))
        prev = text

    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(prev, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask = enc["input_ids"], []
        for tok_start, _ in enc["offset_mapping"]:
            mask.append(next((t for s, e, t in spans if s <= tok_start < e), False))
        return ids, mask
    ids, mask = [], []
    for s, e, trained in spans:
        piece = tokenizer(prev[s:e], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([trained] * len(piece))
    return ids, mask


@dataclass
class Sample:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    """loss_mask[t]: token t is trained (predicted from t - 1); the first token never is."""


def build_samples(rows: list[dict], tokenizer, roles: LossMaskConfig, seq_len: int) -> list[Sample]:
    samples, skipped = [], 0
    for i, row in enumerate(rows):
        messages, tools = to_messages(row, i)
        ids, mask = tokenize_conversation(tokenizer, messages, tools, roles, index=i)
        ids, mask = np.asarray(ids[:seq_len], dtype=np.int64), np.asarray(mask[:seq_len], dtype=np.bool_)
        if len(mask):
            mask[0] = False
        if not mask.any():
            skipped += 1
            continue
        samples.append(Sample(ids, mask))
    if skipped:
        logger.warning("skipped %d of %d samples with no trained token within seq_len=%d", skipped, len(rows), seq_len)
    if not samples:
        raise ValueError("no sample has a trained token: check data.loss_mask and seq_len")
    return samples


# ---------------------------------------------------------------- packing


def pack(samples: list[Sample], order: np.ndarray, seq_len: int, first_sample_id: int = 0) -> list[MicroBatch]:
    """Greedy packing in ``order`` into one-row micro-batches of ``seq_len``; a sample that does not fit starts a new
    row (samples are never split). Padding has ``sample_ids == -1`` and no loss."""
    rows: list[MicroBatch] = []
    row = MicroBatch.empty(1, seq_len)
    pos = 0

    def finish() -> None:
        # Padding restarts position ids at 0 so attention keeps it apart from the last sample.
        row.position_ids[0, pos:] = np.arange(seq_len - pos)
        rows.append(row)

    for sid, idx in enumerate(order):
        s = samples[idx]
        n = len(s.input_ids)
        if pos + n > seq_len:
            finish()
            row, pos = MicroBatch.empty(1, seq_len), 0
        span = slice(pos, pos + n)
        row.input_ids[0, span] = s.input_ids
        row.position_ids[0, span] = np.arange(n)
        row.loss_mask[0, span] = s.loss_mask
        row.sample_ids[0, span] = first_sample_id + sid
        pos += n
    if pos:
        finish()
    return rows


def stack(rows: list[MicroBatch]) -> MicroBatch:
    fields = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "sample_ids")
    return MicroBatch(**{f: np.concatenate([getattr(r, f) for r in rows]) for f in fields})


class PackedData:
    """Packed rows, reshuffled and repacked every epoch; ``next_batch`` yields a rank's micro-batches of a step.

    State is (epoch, rows consumed in the epoch), so a resumed run sees exactly the rows an uninterrupted run would.
    """

    def __init__(
        self, samples: list[Sample], seq_len: int, batch_size: int, micro_batch_size: int, shuffle: bool, seed: int
    ):
        self.samples, self.seq_len = samples, seq_len
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.cursor = 0, 0
        self._rows: list[MicroBatch] | None = None

    def rows(self, epoch: int) -> list[MicroBatch]:
        order = np.arange(len(self.samples))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return pack(self.samples, order, self.seq_len)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor, self._rows = state["epoch"], state["cursor"], None

    def next_batch(self, rank: int, world_size: int) -> list[MicroBatch]:
        per_rank, rest = divmod(self.batch_size, world_size)
        if rest or per_rank % self.micro_batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size} must split into {world_size} ranks x "
                f"micro_batch_size={self.micro_batch_size}"
            )
        batch: list[MicroBatch] = []
        while len(batch) < self.batch_size:
            if self._rows is None:
                self._rows = self.rows(self.epoch)
            take = self._rows[self.cursor : self.cursor + self.batch_size - len(batch)]
            batch.extend(take)
            self.cursor += len(take)
            if self.cursor >= len(self._rows):
                self.epoch, self.cursor, self._rows = self.epoch + 1, 0, None
        mine = batch[rank::world_size]
        return [stack(mine[i : i + self.micro_batch_size]) for i in range(0, len(mine), self.micro_batch_size)]


def eval_batches(
    samples: list[Sample], seq_len: int, micro_batch_size: int, rank: int, world_size: int, max_rows: int | None
) -> list[MicroBatch]:
    """This rank's share of the validation rows (padded so every rank runs as many forward passes)."""
    rows = pack(samples, np.arange(len(samples)), seq_len)[:max_rows]
    per_step = micro_batch_size * world_size
    rows += [MicroBatch.empty(1, seq_len) for _ in range(-len(rows) % per_step)]
    mine = rows[rank::world_size]
    return [stack(mine[i : i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]


def load_tokenizer(name: str, chat_template: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        tokenizer.chat_template = path.read_text() if path.is_file() else chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {name!r} has no chat template: set --data.chat-template")
    return tokenizer
