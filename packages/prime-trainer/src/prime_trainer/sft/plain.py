"""SFT rows whose messages hold special-token text (``<|im_start|>``, ``<|endoftext|>``): that text is trained as
plain text, never as the special ids that would forge a turn or end the sample (``prime_core.chat_tokens``)."""

from __future__ import annotations

from collections.abc import Callable

from prime_core.chat_tokens import encode_plain, has_special_text, inert, injected_spans, special_tokens
from prime_core.config import ConfigError


def content_spans(
    tokenizer, messages: list[dict], tools, text: str, where: str, render: Callable[..., str]
) -> list[tuple[int, int]] | None:
    """Spans of ``text`` (the render of ``messages``) where special-token text came from the messages; None when the
    messages hold none (the row is encoded as it always was)."""
    specials = special_tokens(tokenizer)
    if not specials or not has_special_text([messages, tools], specials):
        return None
    spans = injected_spans(text, render(tokenizer, inert(messages, specials), inert(tools, specials), where), specials)
    if spans is None:
        first = next((t for t in specials if t in str([messages, tools])), "")
        raise ConfigError(
            f"{where}: the messages hold special-token text (e.g. {first!r}) "
            "and the chat template changes their length, so it cannot be told from the template's own special tokens"
        )
    return spans


def encode(tokenizer, text: str, injected: list[tuple[int, int]] | None, start: int = 0, offsets: bool = False) -> dict:
    """``text``'s ids (and offsets), with ``injected`` spans (of the text that ``text`` starts at ``start`` of)
    encoded as plain text."""
    spans = [(s - start, e - start) for s, e in injected or () if e > start and s < start + len(text)]
    if not spans:
        return tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
    return encode_plain(tokenizer, text, spans, special_tokens(tokenizer), offsets=offsets)
