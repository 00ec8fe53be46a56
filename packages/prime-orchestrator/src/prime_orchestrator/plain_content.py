"""Special-token text inside messages is plain text in the token ids renderers build for inference.

A tool's output, an environment's observation or a user turn holding ``<|im_end|>\\n<|im_start|>system\\n...`` or
``<|endoftext|>`` (code the policy wrote prints it in the sandbox) was encoded by renderers as the special ids:
``Qwen3Renderer._encode`` and ``attribute_text_segments`` call ``tokenizer.encode``/``tokenizer(...)`` on content,
``DefaultRenderer._apply`` tokenizes the template's text, all with the tokenizer's default
``split_special_tokens=False``, which renderers keeps on purpose (parity with ``apply_chat_template``) and offers no
option for. So the policy forged turns and roles in the prompt of its next turn.

The renderer's ``render``/``render_ids``/``bridge_to_next_turn`` get messages whose special-token texts are each
replaced by one private-use character, and the renderer gets a tokenizer (``PlainContentTokenizer``) that encodes
those characters back as the token's text with ``split_special_tokens=True`` (``prime_core.chat_tokens``). The
renderer's own special tokens (emitted by id, or in its template's text) stay special; messages without
special-token text render exactly as before.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any

from prime_core.chat_tokens import encode_plain, special_tokens

_HIDDEN: ContextVar[bool] = ContextVar("prime_plain_content_hidden", default=False)
_ESC = chr(0xF0000)  # Supplementary Private Use Area-A: an escape, then one character per special token


class PlainContentTokenizer:
    """``tokenizer`` whose encodes read the placeholders of ``hide`` as plain special-token text."""

    def __init__(self, tokenizer: Any):
        self._inner = tokenizer
        self._specials = special_tokens(tokenizer)
        self._text = {chr(ord(_ESC) + 1 + k): t for k, t in enumerate(self._specials)}
        self._char = {t: c for c, t in self._text.items()}
        # A message's own characters of this range are escaped, so they come back as themselves.
        self._placeholder = re.compile("[" + _ESC + "".join(self._text) + "]") if self._text else None
        self.__call__ = self._instance_call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def hide(self, value: Any) -> Any:
        """``value`` (messages, tools) with each special token's text inside its strings as its placeholder."""
        if isinstance(value, str):
            if self._placeholder is None:
                return value
            value = self._placeholder.sub(lambda m: _ESC + m.group(), value)
            return self._specials.pattern.sub(lambda m: self._char[m.group()], value)
        if isinstance(value, dict):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.hide(v) for v in value)
        return value

    def _hidden(self, text: Any) -> bool:
        return self._placeholder is not None and isinstance(text, str) and self._placeholder.search(text) is not None

    def _restore(self, text: str) -> tuple[str, list[tuple[int, int]], list[int]]:
        """``text`` with its placeholders as token texts, their spans, and each restored index's index in ``text``."""
        out, spans, where = [], [], []
        at, escaped = 0, False
        for i, ch in enumerate(text):
            if ch == _ESC and not escaped:
                escaped = True
                continue
            piece = ch if escaped else self._text.get(ch, ch)
            if piece is not ch:
                spans.append((at, at + len(piece)))
            out.append(piece)
            where.extend([i] * len(piece))
            at += len(piece)
            escaped = False
        where.append(len(text))
        return "".join(out), spans, where

    def _encode(self, text: str, offsets: bool) -> dict[str, list]:
        restored, spans, where = self._restore(text)
        enc = encode_plain(self._inner, restored, spans, self._specials, offsets=offsets)
        if offsets:  # in the caller's text, where a placeholder is one character
            enc["offset_mapping"] = [
                (where[s], where[e - 1] + 1 if e > s else where[s]) for s, e in enc["offset_mapping"]
            ]
        return enc

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and self._hidden(text):
            return self._encode(text, bool(kwargs.get("return_offsets_mapping")))
        return self._inner(text, *args, **kwargs)

    def _instance_call(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        """``tokenizer.__call__`` fetched from the instance (renderers' offset probe): the inner instance's, which
        ``memoise_short_encodes`` memoises, where ``tokenizer(...)`` goes by the type, as on the inner one."""
        if not args and self._hidden(text):
            return self._encode(text, bool(kwargs.get("return_offsets_mapping")))
        return self._inner.__call__(text, *args, **kwargs)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and self._hidden(text):
            return self._encode(text, False)["input_ids"]
        return self._inner.encode(text, *args, **kwargs)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._holds_hidden(conversation):
            return self._inner.apply_chat_template(conversation, *args, **kwargs)
        tokenize = kwargs.pop("tokenize", True)
        return_dict = kwargs.pop("return_dict", False)
        text = self._restore(self._inner.apply_chat_template(conversation, *args, tokenize=False, **kwargs))
        if not tokenize:
            return text[0]
        ids = encode_plain(self._inner, text[0], text[1], self._specials)["input_ids"]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _holds_hidden(self, value: Any) -> bool:
        if isinstance(value, str):
            return self._hidden(value)
        if isinstance(value, dict):
            return any(self._holds_hidden(v) for v in value.values())
        if isinstance(value, list | tuple):
            return any(self._holds_hidden(v) for v in value)
        return False


def plain_content(renderer: Any, tokenizer: PlainContentTokenizer) -> None:
    """Have ``renderer`` (built on ``tokenizer``) render messages' special-token text as plain text. The tools are
    the environment's, not the policy's: they render as they are."""
    for name, at, key in (
        ("render", 0, "messages"),
        ("render_ids", 0, "messages"),
        ("bridge_to_next_turn", 2, "new_messages"),
    ):
        method = getattr(renderer, name, None)
        if method is None:
            continue

        def hiding(*args: Any, _method=method, _at=at, _key=key, **kwargs: Any) -> Any:
            if _HIDDEN.get():  # a renderer method calling another (render_ids -> render): hidden once
                return _method(*args, **kwargs)
            args = tuple(tokenizer.hide(a) if k == _at else a for k, a in enumerate(args))
            if _key in kwargs:
                kwargs[_key] = tokenizer.hide(kwargs[_key])
            token = _HIDDEN.set(True)
            try:
                return _method(*args, **kwargs)
            finally:
                _HIDDEN.reset(token)

        setattr(renderer, name, hiding)
