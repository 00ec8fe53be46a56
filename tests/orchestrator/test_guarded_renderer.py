"""``guarded_renderer``: a completion whose tool call renderers' parser raises on, or whose call no UTF-8 encoder takes,
is content with no tool call (vLLM's answer), for the renderers the orchestrator configures."""

from __future__ import annotations

import pytest

from tests.fixtures.models import build_tool_tokenizer

DEPTH = 20_000


def call(name_json: str, arguments_json: str) -> str:
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments_json}}}</tool_call>'


HOSTILE = {
    "deep": call('"f"', "[" * DEPTH + "]" * DEPTH),  # RecursionError
    "bigint": call('"f"', '{"a": ' + "9" * 5000 + "}"),  # ValueError: CPython's int-string limit
    "surrogate_args": call('"f"', '{"a": "\\ud800"}'),  # parses; no UTF-8 encoder takes it
    "surrogate_name": call('"\\udfff"', "{}"),
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tool_tokenizer()
    tok.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"])  # what renderers' qwen3 needs
    return tok


def build(tokenizer, renderer: dict, **template_kwargs):
    from prime_orchestrator.guarded_renderer import guarded
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    config = TypeAdapter(RendererConfig).validate_python(guarded(renderer))
    return create_renderer(tokenizer, config, chat_template_kwargs=template_kwargs or None)


RENDERERS = {"default": {"name": "default", "tool_parser": "qwen3"}, "qwen3": {"name": "qwen3"}}


def ids(tokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_call_that_does_not_parse_or_encode_is_content(tokenizer, renderer, attack):
    r = build(tokenizer, RENDERERS[renderer])
    parsed = r.parse_response(ids(tokenizer, "I call it. " + HOSTILE[attack]))
    assert parsed.tool_calls == [] and parsed.content == "I call it. " + HOSTILE[attack]


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
def test_honest_calls_parse_as_before(tokenizer, renderer):
    r = build(tokenizer, RENDERERS[renderer])
    parsed = r.parse_response(ids(tokenizer, "hi " + call('"f"', '{"a": "caf\\u00e9", "n": 1}')))
    assert [(c.name, c.arguments, c.status.value) for c in parsed.tool_calls] == [("f", {"a": "café", "n": 1}, "ok")]
    assert type(r).__name__ == {"default": "DefaultRenderer", "qwen3": "Qwen3Renderer"}[renderer]  # its own type


def test_template_kwargs_reach_the_wrapped_renderer(tokenizer):
    from renderers.configs import Qwen3RendererConfig

    assert build(tokenizer, {"name": "qwen3"}, enable_thinking=False).config == Qwen3RendererConfig(
        enable_thinking=False
    )
    with pytest.raises(ValueError, match="Unsupported chat_template_kwargs"):
        build(tokenizer, {"name": "qwen3"}, no_such_kwarg=True)


def test_the_orchestrator_guards_every_renderer(tmp_path):
    from prime_orchestrator.rendering import resolve_renderer

    for name in ("auto", "qwen3", "default"):
        config = resolve_renderer(name, str(tmp_path))
        assert config["import_path"] == "prime_orchestrator.guarded_renderer.guarded_renderer", config


def test_renderers_own_parser_still_raises(tokenizer):
    """Why the guard exists: renderers 0.1.12's Hermes parsers catch ``json.JSONDecodeError`` only. When this fails,
    renderers handles it; the guard's surrogate check may still be needed."""
    from renderers import create_renderer
    from renderers.configs import DefaultRendererConfig

    bare = create_renderer(tokenizer, DefaultRendererConfig(tool_parser="qwen3"))
    with pytest.raises(RecursionError):
        bare.parse_response(ids(tokenizer, HOSTILE["deep"]))
