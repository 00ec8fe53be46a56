"""SFT data: load chat rows, render them with the chat template, mask by role, pack into fixed-length rows.

Row formats: ``messages`` (a whole conversation) wins over ``prompt`` + ``completion`` (strings become a user and an
assistant message; lists are messages). ``tools`` (a list or a JSON string) is passed to the chat template.

Images (vision-language models): message content may be a list of parts, with ``{"type": "image", "image": <path,
bytes, data: URL, base64 or {"bytes", "path"}>}`` or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``;
an ``image`` part without a source takes the next entry of the row's ``images`` column. The chat template renders
one ``<|image_pad|>`` per image, which is expanded to the image's placeholder tokens (never trained); pixels are
decoded and patchified only when a row is built (``prime_core.vision``), so datasets stay small in memory.

Loss masks come from rendering every prefix of the conversation: the text added by message k is attributed to k's
role. This needs the template's prefix property (rendering messages[:k] is a prefix of rendering messages[:k+1]);
templates that rewrite earlier turns (e.g. strip past reasoning) are refused with the first offending message.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prime_core.config import ConfigError
from prime_core.config.trainer import LossMaskConfig
from prime_core.schemas.microbatch import MicroBatch, stack_rows
from prime_core.vision import VisionSpec

from prime_trainer.sft.images import expand_images, row_images, truncate_keeping_images, with_images
from prime_trainer.sft.plain import content_spans, encode
from prime_trainer.sft.rows import TRAINABLE_ROLES, to_messages, where_of
from prime_trainer.sft.rows import load_rows as load_rows  # re-exported: the data API is this module
from prime_trainer.sft.rows import load_tokenizer as load_tokenizer

logger = logging.getLogger("prime.sft")

# ---------------------------------------------------------------- tokenization with role masks


class PrefixPropertyError(ConfigError):
    pass


_MARGIN = 64
"""Tokens kept past ``max_tokens`` when only a prefix of a long text is tokenized: the tokens near the cut may differ
from the whole text's, those well before it do not."""


def render(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, where: str, **kwargs) -> str:
    try:
        return render(tokenizer, messages, tools, **kwargs)
    except Exception as e:  # a template's raise_exception, or any error of its code on this row's data
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ConfigError(f"{where}: the chat template failed on messages[:{len(messages)}] ({reason})") from None


def _encode(tokenizer, text: str, max_tokens: int | None, injected=None) -> tuple[dict, bool]:
    """Ids and offsets of ``text``, or of a prefix of it with more than ``max_tokens`` tokens (plus a margin): a
    huge row costs what ``seq_len`` keeps of it, not its size. The flag: the whole text was encoded."""
    limit = len(text) if max_tokens is None else 4 * (max_tokens + _MARGIN)
    while True:
        enc = encode(tokenizer, text[:limit], injected, offsets=True)
        if limit >= len(text) or len(enc["input_ids"]) > max_tokens + _MARGIN:
            return enc, limit >= len(text)
        limit *= 4


def _prefix_error(where: str, k: int, message: dict, prev: str, text: str) -> PrefixPropertyError:
    at = next((i for i, (a, b) in enumerate(zip(prev, text, strict=False)) if a != b), min(len(prev), len(text)))
    return PrefixPropertyError(
        f"{where}: the chat template lacks the prefix property: adding message {k} "
        f"(role {message.get('role')!r}) changes how messages[:{k}] render (first difference at character "
        f"{at}: {prev[at : at + 40]!r} became {text[at : at + 40]!r}). Templates that rewrite earlier turns (e.g. "
        "strip past reasoning) cannot be masked by role; use a template that keeps history verbatim "
        "(--data.chat-template)."
    )


_warned_header = False


def _header_end(tokenizer, messages: list[dict], k: int, tools, where: str, prev: str, text: str) -> int:
    """Where the role header the template adds before assistant message ``k`` (its generation prompt) ends in
    ``text``; ``len(prev)`` when there is none, or when the turn does not start with it (warned once: the header is
    then trained with the turn)."""
    global _warned_header
    if k == 0:
        return _opening_header_end(tokenizer, tools, text)
    header = _render(tokenizer, messages[:k], tools, where, add_generation_prompt=True)
    if header.startswith(prev) and text.startswith(header):
        return len(header)
    if not _warned_header and header.startswith(prev):
        _warned_header = True
        logger.warning(
            "%s: the chat template's generation prompt %r does not start its assistant turn %r: assistant turns whose "
            "header differs are trained from their first character, header included",
            where,
            header[len(prev) :][:60],
            text[len(prev) :][:60],
        )
    return len(prev)


def _opening_header_end(tokenizer, tools, text: str) -> int:
    """Where the text before an assistant message that opens the conversation ends: its role header, and a default
    system prompt some templates add (Qwen2.5's) when no system message leads. No conversation renders the header
    alone (a template may read ``messages[0]``), so it is the one the template adds after a user turn, found in
    ``text``; 0 when there is none (the turn is then trained from its first character, as before)."""
    user = [{"role": "user", "content": "."}]
    try:
        turn = render(tokenizer, user, tools)
        header = render(tokenizer, user, tools, add_generation_prompt=True)
    except Exception:  # a template that refuses a user turn without a system message: nothing to learn from it
        return 0
    header = header[len(turn) :] if header.startswith(turn) else ""
    at = text.find(header) if header.strip() else -1
    return at + len(header) if at >= 0 else 0


def _trains(roles: LossMaskConfig, role: str) -> bool:
    # Only the config's role fields: getattr alone found pydantic's methods (roles `json`, `copy` were trained).
    return role in TRAINABLE_ROLES and bool(getattr(roles, role))


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    roles: LossMaskConfig,
    index: int | str = 0,
    max_tokens: int | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained (by its message's role).

    The role header the template adds before an assistant message (its generation prompt) is never trained. With
    ``max_tokens``, rendering stops once the text holds more than that many tokens and only a prefix is returned.
    """
    return _tokenize(tokenizer, messages, tools, roles, index, max_tokens)[:2]


def _tokenize(
    tokenizer, messages: list[dict], tools, roles: LossMaskConfig, index: int | str, max_tokens: int | None
) -> tuple[list[int], list[bool], bool]:
    """``tokenize_conversation``, and whether the ids cover the whole conversation (not only a prefix)."""
    where = f"row {index}" if isinstance(index, int) else index
    spans: list[tuple[int, int, bool]] = []  # character spans of the full text and whether they are trained
    prev = ""
    check_at = max_tokens or 0
    for k, message in enumerate(messages):
        text = _render(tokenizer, messages[: k + 1], tools, where)
        if not text.startswith(prev):
            raise _prefix_error(where, k, message, prev, text)
        try:
            text[len(prev) :].encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(
                f"{where}: messages[{k}] renders {text[len(prev) + e.start]!r}, a lone surrogate (a JSON escape such as "
                "\\ud800 that is not a character): no tokenizer reads it"
            ) from None
        content = message.get("content")
        if isinstance(content, list) and content and str(content) in text[len(prev) :]:
            raise ConfigError(
                f"{where}: the chat template rendered messages[{k}].content, a list of parts, as its Python repr "
                "(the template only handles string content: join the text parts, or use a template that renders parts)"
            )
        role = message.get("role", "")
        # OpenAI's fine-tuning format: `weight: 0` keeps a message out of the loss.
        trained = _trains(roles, role) and message.get("weight", 1) != 0
        start = len(prev)
        if role == "assistant":
            start = _header_end(tokenizer, messages, k, tools, where, prev, text)
            spans.append((len(prev), start, False))
        spans.append((start, len(text), trained))
        prev = text
        # A conversation far longer than max_tokens stops here rather than rendering every later prefix.
        if max_tokens is not None and len(prev) >= check_at and k < len(messages) - 1:
            if len(_encode(tokenizer, prev, max_tokens)[0]["input_ids"]) > max_tokens + _MARGIN:
                injected = content_spans(tokenizer, messages[: k + 1], tools, prev, where, _render)
                return *_ids_and_mask(tokenizer, prev, spans, max_tokens, injected)[:2], False
            check_at = 2 * len(prev)
    injected = content_spans(tokenizer, messages, tools, prev, where, _render)
    return _ids_and_mask(tokenizer, prev, spans, max_tokens, injected)


def _ids_and_mask(
    tokenizer, text: str, spans: list[tuple[int, int, bool]], max_tokens: int | None, injected=None
) -> tuple[list[int], list[bool], bool]:
    """Token ids of ``text``, whether each is trained (the span its first character falls in), and whether they
    cover all of ``text``. ``injected``: spans of special-token text from the messages, encoded as plain text."""
    starts = [s for s, _, _ in spans]
    if getattr(tokenizer, "is_fast", False):
        enc, whole = _encode(tokenizer, text, max_tokens, injected)
        ids, mask = list(enc["input_ids"]), []
        for tok_start, _ in enc["offset_mapping"]:
            j = bisect.bisect_right(starts, tok_start) - 1
            mask.append(j >= 0 and tok_start < spans[j][1] and spans[j][2])
        return ids, mask, whole
    ids, mask = [], []
    for n, (s, e, trained) in enumerate(spans):
        # Slow tokenizers have no offsets: a span is cut at a generous 16 characters per token, and nothing follows it.
        cut = e if max_tokens is None else min(e, s + 16 * (max_tokens + _MARGIN))
        piece = encode(tokenizer, text[s:cut], injected, start=s)["input_ids"]
        ids.extend(piece)
        mask.extend([trained] * len(piece))
        if cut < e or (max_tokens is not None and len(ids) > max_tokens and n < len(spans) - 1):
            return ids, mask, False
    return ids, mask, True


@dataclass
class Sample:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    """loss_mask[t]: token t is trained (predicted from t - 1); the first token never is."""
    images: list[Any] = field(default_factory=list)
    """Image sources (decoded when a row is built), in placeholder order."""
    image_grid_thw: np.ndarray | None = None
    """[num_images, 3] patch grids of ``images``."""
    mrope_position_ids: np.ndarray | None = None
    """[3, len] rotary positions of a sample with images."""


def _drop_cause(trained_beyond: bool, was_cut: bool, has_trained_role: bool, seq_len: int) -> str:
    if trained_beyond or (was_cut and has_trained_role):
        return f"their first trained token is past seq_len={seq_len}"
    if has_trained_role:
        return "the chat template renders no text for their trained messages (data.loss_mask roles)"
    return "they have no message of a trained role (data.loss_mask)"


def build_samples(
    rows: list[dict],
    tokenizer,
    roles: LossMaskConfig,
    seq_len: int,
    vision: VisionSpec | None = None,
    source: str = "data.path",
    vocab_size: int | None = None,
) -> list[Sample]:
    """Tokenized, masked samples of ``rows`` cut to ``seq_len``; rows left with no trained token are skipped and
    counted by cause, and a dataset with no trained token at all is a ``ConfigError`` naming the cause. A token id
    past the model's ``vocab_size`` (a tokenizer that is not the model's) is a ``ConfigError`` naming the row."""
    samples: list[Sample] = []
    # cause -> [count, where the first row of that cause came from]
    dropped: dict[str, list] = {}
    unknown_roles: dict[str, str] = {}
    cut = 0
    for i, row in enumerate(rows):
        where = where_of(rows, i)
        messages, tools = to_messages(row, where)
        for m in messages:
            if m["role"] not in TRAINABLE_ROLES and m["role"] not in unknown_roles:
                unknown_roles[m["role"]] = where
        ids, mask, whole = _tokenize(tokenizer, messages, tools, roles, where, seq_len)
        images = row_images(row, messages, where)
        ids, mask, grids = expand_images(ids, mask, images, vision, where, prefix=not whole)
        keep = truncate_keeping_images(ids, grids, seq_len, vision)
        was_cut = keep < len(ids)
        cut += was_cut
        trained_beyond = any(mask[keep:])
        ids, mask = np.asarray(ids[:keep], dtype=np.int64), np.asarray(mask[:keep], dtype=np.bool_)
        if vocab_size is not None and len(ids) and (top := int(ids.max())) >= vocab_size:
            raise ConfigError(
                f"{where}: token id {top} ({tokenizer.convert_ids_to_tokens(top)!r}) is past the model's "
                f"vocab_size={vocab_size}: the tokenizer does not belong to this model"
            )
        if len(mask):
            mask[0] = False
        if not mask.any():
            has_trained_role = any(_trains(roles, m["role"]) and m.get("weight", 1) != 0 for m in messages)
            dropped.setdefault(_drop_cause(trained_beyond, was_cut, has_trained_role, seq_len), [0, where])[0] += 1
            continue
        samples.append(with_images(Sample(ids, mask), images, grids, vision))
    for role, where in unknown_roles.items():
        logger.warning(
            "%s: role %r is never trained (data.loss_mask trains %s)", where, role, "/".join(TRAINABLE_ROLES)
        )
    causes = "; ".join(f"{n} because {cause} (first: {where})" for cause, (n, where) in dropped.items())
    if not rows:
        raise ConfigError(f"{source}: no rows")
    if not samples:
        raise ConfigError(f"{source}: none of its {len(rows)} rows has a trained token: {causes}")
    if dropped:
        logger.warning("%s: skipped %d of %d rows: %s", source, len(rows) - len(samples), len(rows), causes)
    if cut:
        logger.warning("%s: %d of %d rows were cut to seq_len=%d", source, cut, len(rows), seq_len)
    return samples


# ---------------------------------------------------------------- packing


RowPlan = list[tuple[int, int]]
"""One packed row: (sample index, sample id) in row order."""


def plan_rows(samples: list[Sample], order: np.ndarray, seq_len: int, first_sample_id: int = 0) -> list[RowPlan]:
    """Greedy packing in ``order`` into rows of ``seq_len``; a sample that does not fit starts a new row (samples are
    never split)."""
    plans: list[RowPlan] = [[]]
    pos = 0
    for sid, idx in enumerate(order):
        n = len(samples[idx].input_ids)
        if pos + n > seq_len:
            plans.append([])
            pos = 0
        plans[-1].append((int(idx), first_sample_id + sid))
        pos += n
    return [p for p in plans if p]


def build_row(samples: list[Sample], plan: RowPlan, seq_len: int, vision: VisionSpec | None = None) -> MicroBatch:
    """A one-row micro-batch; padding has ``sample_ids == -1``, no loss, and position ids restarting at 0 (so
    attention keeps it apart from the last sample). Images are decoded and patchified here."""
    row = MicroBatch.empty(1, seq_len)
    image_spans: list[tuple[slice, np.ndarray]] = []
    images, grids = [], []
    pos = 0
    for idx, sid in plan:
        s = samples[idx]
        n = len(s.input_ids)
        span = slice(pos, pos + n)
        row.input_ids[0, span] = s.input_ids
        row.position_ids[0, span] = np.arange(n)
        row.loss_mask[0, span] = s.loss_mask
        row.sample_ids[0, span] = sid
        if s.images:
            image_spans.append((span, s.mrope_position_ids))
            images += s.images
            grids.append(s.image_grid_thw)
        pos += n
    row.position_ids[0, pos:] = np.arange(seq_len - pos)
    if image_spans:
        mrope = np.broadcast_to(row.position_ids, (3, 1, seq_len)).copy()
        for span, positions in image_spans:
            mrope[:, 0, span] = positions
        pixel_values, grid_thw = vision.processor.process_many(images)
        if not np.array_equal(grid_thw, np.concatenate(grids)):
            raise ValueError("an image's patch grid changed between tokenization and row building")
        row.pixel_values, row.image_grid_thw, row.mrope_position_ids = pixel_values, grid_thw, mrope
    return row


def pack(
    samples: list[Sample], order: np.ndarray, seq_len: int, first_sample_id: int = 0, vision: VisionSpec | None = None
) -> list[MicroBatch]:
    """``plan_rows`` then ``build_row`` for every row."""
    return [build_row(samples, p, seq_len, vision) for p in plan_rows(samples, order, seq_len, first_sample_id)]


def stack(rows: list[MicroBatch]) -> MicroBatch:
    return stack_rows(rows)


class PackedData:
    """Packed rows, reshuffled and repacked every epoch; ``next_batch`` yields a rank's micro-batches of a step.

    State is (epoch, rows consumed in the epoch), so a resumed run sees exactly the rows an uninterrupted run would.
    """

    def __init__(
        self,
        samples: list[Sample],
        seq_len: int,
        batch_size: int,
        micro_batch_size: int,
        shuffle: bool,
        seed: int,
        vision: VisionSpec | None = None,
    ):
        self.samples, self.seq_len = samples, seq_len
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.vision = vision
        self.epoch, self.cursor = 0, 0
        self._rows: list[RowPlan] | None = None

    def rows(self, epoch: int) -> list[RowPlan]:
        order = np.arange(len(self.samples))
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return plan_rows(self.samples, order, self.seq_len)

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "data": self._shape()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor, self._rows = state["epoch"], state["cursor"], None
        saved, now = state.get("data"), self._shape()
        if isinstance(saved, dict) and (changed := [k for k in now if k in saved and saved[k] != now[k]]):
            logger.warning(
                "resuming with other data than the checkpoint's (%s): its data position (epoch %d, row %d) indexes "
                "other packed rows, so the rows this run skips and repeats are not those of the run it continues",
                ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed),
                self.epoch,
                self.cursor,
            )

    def _shape(self) -> dict[str, Any]:
        """What the data position depends on: the samples (count, tokens, a digest of their lengths) and packing."""
        lengths = np.asarray([len(s.input_ids) for s in self.samples], dtype=np.int64)
        digest = hashlib.sha256(lengths.tobytes()).hexdigest()[:16]
        return {"samples": len(lengths), "tokens": int(lengths.sum()), "lengths": digest, "seq_len": self.seq_len,
                "shuffle": self.shuffle, "seed": self.seed}  # fmt: skip

    def next_batch(self, rank: int, world_size: int) -> list[MicroBatch]:
        per_rank, rest = divmod(self.batch_size, world_size)
        if rest or per_rank % self.micro_batch_size:
            raise ConfigError(
                f"data.batch_size={self.batch_size} must split into {world_size} ranks x "
                f"micro_batch_size={self.micro_batch_size}"
            )
        batch: list[RowPlan] = []
        while len(batch) < self.batch_size:
            if self._rows is None:
                self._rows = self.rows(self.epoch)
            take = self._rows[self.cursor : self.cursor + self.batch_size - len(batch)]
            batch.extend(take)
            self.cursor += len(take)
            if self.cursor >= len(self._rows):
                self.epoch, self.cursor, self._rows = self.epoch + 1, 0, None
        mine = [build_row(self.samples, plan, self.seq_len, self.vision) for plan in batch[rank::world_size]]
        return [stack(mine[i : i + self.micro_batch_size]) for i in range(0, len(mine), self.micro_batch_size)]


def eval_batches(
    samples: list[Sample],
    seq_len: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    max_rows: int | None,
    vision: VisionSpec | None = None,
) -> list[MicroBatch]:
    """This rank's share of the validation rows (padded so every rank runs as many forward passes)."""
    rows = pack(samples, np.arange(len(samples)), seq_len, vision=vision)[:max_rows]
    per_step = micro_batch_size * world_size
    rows += [MicroBatch.empty(1, seq_len) for _ in range(-len(rows) % per_step)]
    mine = rows[rank::world_size]
    return [stack(mine[i : i + micro_batch_size]) for i in range(0, len(mine), micro_batch_size)]
