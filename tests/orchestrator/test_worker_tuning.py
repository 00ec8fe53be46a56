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


def _tool_tokenizer():
    from tests.fixtures.models import build_tool_tokenizer

    tok = build_tool_tokenizer()
    tok.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"])  # what renderers' qwen3 needs
    return tok


def _guarded_qwen3(tokenizer):
    from prime_orchestrator.guarded_renderer import guarded
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    return create_renderer(tokenizer, TypeAdapter(RendererConfig).validate_python(guarded({"name": "qwen3"})))


def test_a_turn_renders_and_parses_as_before_without_re_encoding_its_headers():
    """The orchestrator's renderer: the same prompt ids, attribution and parse as renderers' own, and the second turn
    encodes only its own text (the assistant header and the offset probe come from memory)."""
    from renderers import Qwen3RendererConfig, create_renderer

    plain = _tool_tokenizer()
    bare = create_renderer(plain, Qwen3RendererConfig())
    tokenizer = _tool_tokenizer()
    encoded, called = [], []
    original_encode, original_call = tokenizer.encode, tokenizer.__call__
    tokenizer.encode = lambda *a, **k: encoded.append(a) or original_encode(*a, **k)
    tokenizer.__call__ = lambda *a, **k: called.append(a) or original_call(*a, **k)
    ours = _guarded_qwen3(tokenizer)
    counts = []
    for turn in ("reverse: abc", "reverse: a much longer text than the last one"):
        messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": turn}]
        want, got = bare.render(messages, add_generation_prompt=True), ours.render(messages, add_generation_prompt=True)
        assert got.token_ids == want.token_ids and got.is_content == want.is_content
        assert got.message_indices == want.message_indices
        completion = plain.encode("<think>\nhm\n</think>\n\ncba", add_special_tokens=False)
        parse = dict(prompt_ids=want.token_ids)
        assert ours.parse_response(completion, **parse) == bare.parse_response(completion, **parse)
        counts.append((len(encoded), len(called)))
    assert counts[1] == counts[0]  # nothing short re-encoded on the second turn


def test_memoised_answers_are_copies_and_follow_the_vocabulary():
    from prime_orchestrator.worker_tuning import MAX_SHORT_TEXT, memoise_short_encodes

    tokenizer = _tool_tokenizer()
    memoise_short_encodes(tokenizer)
    memoise_short_encodes(tokenizer)  # idempotent
    first = tokenizer.encode("hello zqx", add_special_tokens=False)
    first.append(-1)
    assert tokenizer.encode("hello zqx", add_special_tokens=False) == first[:-1]
    probe = tokenizer.__call__("a", add_special_tokens=False, return_offsets_mapping=True)
    probe["input_ids"].append(-1)
    again = tokenizer.__call__("a", add_special_tokens=False, return_offsets_mapping=True)
    assert again["input_ids"] == probe["input_ids"][:-1] and again["offset_mapping"] == [(0, 1)]
    assert again.encodings is not None and again.char_to_token(0) == 0
    tokenizer.add_tokens(["zqx"])  # a token added later changes the answer
    assert tokenizer.encode("hello zqx", add_special_tokens=False)[-1] == tokenizer.convert_tokens_to_ids("zqx")
    long = "x " * MAX_SHORT_TEXT
    assert tokenizer.encode(long, add_special_tokens=False) == tokenizer._tokenizer.encode(long).ids
