"""Process-wide settings of an env-server worker that cut its CPU per rollout without changing what a rollout computes.

- pydantic's ``model_construct`` asks, for every field it fills from a ``default_factory``, whether that factory takes
  the validated data, and answers by ``inspect.signature`` each time (pydantic 2.14 caches it for private attributes
  only). For a builtin factory such as ``list`` that parses the type's text signature: ~170 us a field. verifiers
  builds every trace node with ``MessageNode.model_construct`` (two factory fields: ``semantic_parents=list``,
  ``timestamp=time.time``), ~7% of a worker's CPU on reverse-text. A factory's signature does not change, so the
  answer is memoised per factory.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("prime.orchestrator.env")

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
