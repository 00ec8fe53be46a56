"""The env worker's process settings (``prime_orchestrator.worker_tuning``): same results, less work per rollout."""

from __future__ import annotations

import time

import pytest
from prime_orchestrator.worker_tuning import memoise_factory_signatures
from pydantic import BaseModel, Field
from pydantic._internal import _fields, _typing_extra


@pytest.fixture
def memoised(monkeypatch):
    monkeypatch.setattr(_fields, "takes_validated_data_argument", _fields.takes_validated_data_argument)
    memoise_factory_signatures()
    memoise_factory_signatures()  # idempotent: one layer
    assert not getattr(_fields.takes_validated_data_argument.__wrapped__, "_prime_memoised", False)


def test_trace_nodes_ask_for_each_factory_signature_once(memoised, monkeypatch):
    """verifiers builds every trace node with ``model_construct``; pydantic inspected each default factory's
    signature on every call (~170 us for ``list``). Memoised, the second node inspects nothing."""
    from verifiers.v1.graph import MessageNode

    calls = []
    original = _typing_extra.signature_no_eval
    monkeypatch.setattr(_typing_extra, "signature_no_eval", lambda f: calls.append(f) or original(f))
    message = {"role": "user", "content": "hi"}
    first = MessageNode.model_construct(parent=None, message=message, token_ids=[1, 2], mask=[False, False])
    seen = len(calls)
    second = MessageNode.model_construct(parent=0, message=message, token_ids=[3], mask=[True])
    assert seen > 0 and len(calls) == seen
    assert first.semantic_parents == [] and second.semantic_parents == []
    assert first.semantic_parents is not second.semantic_parents  # the factory still runs per node
    assert second.timestamp >= first.timestamp > time.time() - 60


def test_factories_taking_data_still_get_it(memoised):
    class Model(BaseModel):
        a: int = 1
        b: int = Field(default_factory=lambda data: data["a"] + 1)
        c: list[int] = Field(default_factory=list)
        d: int = Field(default_factory=lambda: 7)

    for _ in range(2):
        model = Model.model_construct(a=5)
        assert (model.b, model.c, model.d) == (6, [], 7)
        assert Model(a=2).b == 3


def test_unhashable_factories_are_answered_uncached(memoised):
    class Factory:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, data):
            return data["a"] * 2

    class Model(BaseModel):
        a: int = 1
        b: int = Field(default_factory=Factory())

    assert Model.model_construct(a=4).b == 8
    assert Model.model_construct(a=5).b == 10
