"""Process-wide settings of an env-server worker that cut its CPU per rollout without changing what a rollout computes.

- pydantic's ``model_construct`` asks, for every field it fills from a ``default_factory``, whether that factory takes
  the validated data, and answers by ``inspect.signature`` each time (pydantic 2.14 caches it for private attributes
  only). For a builtin factory such as ``list`` that parses the type's text signature: ~170 us a field. verifiers
  builds every trace node with ``MessageNode.model_construct`` (two factory fields: ``semantic_parents=list``,
  ``timestamp=time.time``), ~7% of a worker's CPU on reverse-text. A factory's signature does not change, so the
  answer is memoised per factory.
- renderers encodes the same short strings on every turn: the Qwen3 renderer's parse re-encodes its assistant header
  ``<|im_start|>assistant\n`` three times (``prompt_ends_in_reasoning``, ``scan_reasoning``), and every render probes
  the tokenizer with ``tokenizer.__call__("a", return_offsets_mapping=True)`` (``_get_offset_tokenizer``): ~12% of
  a worker's samples. ``memoise_short_encodes`` answers a repeated short text from memory, as a fresh copy, so a
  caller that mutates what it got changes nothing for the next one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("prime.orchestrator.env")

MAX_SHORT_TEXT = 64
"""Texts up to this many characters are memoised (headers, markers, probes; a turn's body rarely repeats)."""

MAX_SHORT_TEXTS = 1024
"""Distinct (text, arguments, vocabulary size) answers kept per tokenizer, least recently used dropped."""

MAX_FACTORIES = 4096
"""Factories remembered; past this (factories made per call) the answer is computed each time, as pydantic does."""


def memoise_factory_signatures() -> None:
    """Memoise pydantic's ``takes_validated_data_argument`` in this process (idempotent)."""
    try:
        from pydantic._internal import _fields
    except ImportError:  # a pydantic without the module: nothing to memoise
        return
    original = getattr(_fields, "takes_validated_data_argument", None)
    if original is None or getattr(original, "_prime_memoised", False):
        return
    _fields.takes_validated_data_argument = _memoised(original)


def _memoised(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    answers: dict[Any, bool] = {}

    @functools.wraps(original)
    def takes_validated_data_argument(default_factory: Any) -> bool:
        try:
            return answers[default_factory]
        except KeyError:
            pass
        except TypeError:  # an unhashable callable
            return original(default_factory)
        answer = original(default_factory)
        if len(answers) < MAX_FACTORIES:
            answers[default_factory] = answer
        return answer

    takes_validated_data_argument._prime_memoised = True  # type: ignore[attr-defined]
    return takes_validated_data_argument


def memoise_short_encodes(tokenizer: Any) -> None:
    """Memoise ``tokenizer.encode`` and ``tokenizer.__call__`` of one tokenizer instance for short ``str`` texts
    (idempotent). Keyed by the text, the keyword arguments and the vocabulary size (tokens added later change the
    answer); any other call (a long text, a batch, a text pair, unhashable arguments) goes to the tokenizer.
    ``tokenizer(...)`` itself looks ``__call__`` up on the type and is unchanged; renderers' offset probe fetches
    ``tokenizer.__call__`` from the instance."""
    if getattr(tokenizer, "_prime_short_encodes", False) or not hasattr(tokenizer, "encode"):
        return

    encode, call = tokenizer.encode, tokenizer.__call__

    @functools.lru_cache(maxsize=MAX_SHORT_TEXTS)
    def encoded(text: str, kwargs: tuple, size: int) -> tuple[int, ...]:
        return tuple(encode(text, **dict(kwargs)))

    @functools.lru_cache(maxsize=MAX_SHORT_TEXTS)
    def called(text: str, kwargs: tuple, size: int) -> Any:
        return call(text, **dict(kwargs))

    def key(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        if len(args) != 1 or not isinstance(args[0], str) or len(args[0]) > MAX_SHORT_TEXT:
            return None
        items = tuple(sorted(kwargs.items()))
        try:
            hash(items)
        except TypeError:
            return None
        return args[0], items, len(tokenizer)

    @functools.wraps(encode)
    def short_encode(*args: Any, **kwargs: Any) -> Any:
        k = key(args, kwargs)
        if k is None or kwargs.get("return_tensors") is not None:
            return encode(*args, **kwargs)
        return list(encoded(*k))

    @functools.wraps(call)
    def short_call(*args: Any, **kwargs: Any) -> Any:
        k = key(args, kwargs)
        if k is None or kwargs.get("return_tensors") is not None:
            return call(*args, **kwargs)
        answer = called(*k)
        # transformers' BatchEncoding, recognised by what it carries: the orchestrator does not import transformers
        if not all(hasattr(answer, a) for a in ("items", "encodings", "n_sequences")):
            return answer
        data = {name: list(value) if isinstance(value, list) else value for name, value in answer.items()}
        return type(answer)(data, encoding=answer.encodings, n_sequences=answer.n_sequences)

    try:
        tokenizer.encode, tokenizer.__call__ = short_encode, short_call
        tokenizer._prime_short_encodes = True
    except AttributeError:  # slots or a read-only type: left as it is
        logger.debug("tokenizer %s keeps its own encode", type(tokenizer).__name__)
