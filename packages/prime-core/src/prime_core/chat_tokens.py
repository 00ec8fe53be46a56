"""Token ids of a rendered chat in which special-token TEXT inside messages is plain text.

A chat template renders messages to text, and the tokenizer reads every special token's text in it as that special
id: a message whose content holds ``<|im_end|>\\n<|im_start|>system\\n...`` (a user, a tool's output that the policy
printed, an SFT row) forges turns and roles, and ``<|endoftext|>`` ends a sample. Only the template's own special
tokens are special; the text messages bring in is encoded with HF's ``split_special_tokens=True``.

Which occurrences are the template's: the messages are rendered a second time with every special-token text inside
their strings replaced by letters of the same length (``inert``); an occurrence is the template's when the second
render has it at the same place. A template that changes lengths of message text around such an occurrence cannot
be told apart and is refused (``injected_spans`` returns None). Messages without special-token text (all normal
data) are encoded exactly as before, in one call.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any


class Specials(dict):
    """Text -> id of a tokenizer's special added tokens (those ``split_special_tokens`` splits), and ``pattern``,
    which finds their texts (longest first)."""

    def __init__(self, tokens: dict[str, int]):
        super().__init__(tokens)
        alternatives = "|".join(re.escape(t) for t in sorted(self, key=len, reverse=True))
        self.pattern = re.compile(alternatives) if self else None


def special_tokens(tokenizer: Any) -> Specials:
    """The tokenizer's ``Specials`` (cached on it)."""
    cached = getattr(tokenizer, "_prime_special_tokens", None)
    if cached is None:
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        cached = Specials({t.content: i for i, t in decoder.items() if getattr(t, "special", False) and t.content})
        with contextlib.suppress(AttributeError):
            tokenizer._prime_special_tokens = cached
    return cached


def has_special_text(value: Any, specials: Specials) -> bool:
    """Whether any string in ``value`` (nested dicts, lists, tuples) holds a special token's text."""
    if isinstance(value, str):
        return specials.pattern is not None and specials.pattern.search(value) is not None
    if isinstance(value, dict):
        return any(has_special_text(v, specials) for v in value.values())
    if isinstance(value, list | tuple):
        return any(has_special_text(v, specials) for v in value)
    return False


def inert(value: Any, specials: Specials) -> Any:
    """``value`` with each special token's text inside its strings replaced by as many letters."""
    if isinstance(value, str):
        pattern = specials.pattern
        return value if pattern is None else pattern.sub(lambda m: "x" * len(m.group()), value)
    if isinstance(value, dict):
        return {k: inert(v, specials) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(inert(v, specials) for v in value)
    return value


def injected_spans(text: str, inert_text: str, specials: Specials) -> list[tuple[int, int]] | None:
    """Character spans of ``text`` where a special token's text came from the messages, not the template (the
    ``inert`` render lacks it there); None when the two renders differ in length (the template changed the text)."""
    if len(text) != len(inert_text):
        return None
    pattern = specials.pattern
    if pattern is None:
        return []
    return [(m.start(), m.end()) for m in pattern.finditer(text) if inert_text[m.start() : m.end()] != m.group()]


def encode_plain(
    tokenizer: Any, text: str, injected: list[tuple[int, int]], specials: Specials, offsets: bool = False
) -> dict[str, list]:
    """``text``'s ids (and offsets) with the template's special tokens as their ids and everything between them,
    ``injected`` spans included, encoded with ``split_special_tokens=True`` (special-token text is plain text).

    Tokenizers split their input at special tokens before anything else, so encoding the pieces between them one at
    a time gives the ids that one call gives."""
    pattern = specials.pattern
    ids: list[int] = []
    spans: list[tuple[int, int]] = []

    def piece(start: int, end: int) -> None:
        if start >= end:
            return
        enc = tokenizer(
            text[start:end], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=offsets
        )
        ids.extend(enc["input_ids"])
        if offsets:
            spans.extend((start + s, start + e) for s, e in enc["offset_mapping"])

    at = 0
    cut = iter(sorted(injected))
    nxt = next(cut, None)
    for m in pattern.finditer(text) if pattern is not None else ():
        while nxt is not None and nxt[1] <= m.start():
            nxt = next(cut, None)
        if nxt is not None and nxt[0] < m.end() and m.start() < nxt[1]:
            continue  # the messages' text: stays in the piece, split
        piece(at, m.start())
        ids.append(specials[m.group()])
        spans.append((m.start(), m.end()))
        at = m.end()
    piece(at, len(text))
    out: dict[str, list] = {"input_ids": ids}
    if offsets:
        out["offset_mapping"] = spans
    return out
