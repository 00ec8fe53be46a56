"""Tool calling on by default where it can work: the tool-call parser found from how the chat template writes tool
calls (templates of each format, written for these tests), the startup line, the flags vLLM gets, and the 400 that
names both settings where nothing matches."""

from __future__ import annotations

import logging

import httpx
import pytest
from prime_core.config.inference import InferenceConfig
from prime_inference.engines.vllm_engine import vllm_cli_args
from prime_inference.tool_calling import detect_tool_parser, resolve_tool_calling

from tests.tiny import build_chatml_tokenizer

from .helpers import CORPUS, start_server
from .surface import QWEN3_STYLE_TEMPLATE, TOOLS, FixedTextEngine, build_surface_tokenizer

TOOLS_IN_SYSTEM = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
)


def template(call: str) -> str:
    """A ChatML template that shows the tools and writes each assistant tool call as ``call`` (jinja over ``tc``,
    the call's function, and ``k, v`` its arguments)."""
    return (
        TOOLS_IN_SYSTEM + "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
        "{%- for t in m['tool_calls'] or [] %}{% set tc = t['function'] %}" + call + "{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


ARGS_JSON = "{{ tc['arguments'] | tojson }}"
QWEN3_CODER = (
    "<tool_call>\n<function={{ tc['name'] }}>\n{% for k, v in tc['arguments'].items() %}<parameter={{ k }}>\n{{ v }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>"
)
GLM47 = (
    "<tool_call>{{ tc['name'] }}{% for k, v in tc['arguments'].items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>"
)
LLAMA3 = '{"name": "{{ tc[\'name\'] }}", "parameters": ' + ARGS_JSON + "}"
GLM_TOKENS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]


def tokenizer_with(chat_template: str | None, tokens: list[str] = ()):
    tokenizer = build_chatml_tokenizer(CORPUS)
    tokenizer.add_tokens(list(tokens))
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.mark.parametrize(
    ("chat_template", "tokens", "torch", "vllm"),
    [
        (QWEN3_STYLE_TEMPLATE, ["<tool_call>", "</tool_call>"], "hermes", "hermes"),
        (template(QWEN3_CODER), ["<tool_call>", "</tool_call>"], "qwen3_coder", "qwen3_coder"),
        (template(GLM47), GLM_TOKENS, "glm47", "glm47"),
        (template(GLM47.replace("}}{% for", "}}\n{% for")), GLM_TOKENS, "glm45", "glm45"),
        (template(LLAMA3), [], None, "llama3_json"),  # a format only vLLM parses
        # hermes' markers as plain text (not tokens): renderers' parser reads token ids, vLLM's reads text
        (QWEN3_STYLE_TEMPLATE, [], None, "hermes"),
    ],
)
def test_the_parser_is_the_one_the_template_writes(chat_template, tokens, torch, vllm):
    tokenizer = tokenizer_with(chat_template, tokens)
    assert detect_tool_parser(tokenizer, "torch")[0] == torch
    assert detect_tool_parser(tokenizer, "vllm")[0] == vllm


@pytest.mark.parametrize(
    ("chat_template", "why"),
    [
        (None, "no chat template"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "does not render tools"),
        (TOOLS_IN_SYSTEM + "{% for m in messages %}{{ m['content'] }}{% endfor %}", "not an assistant's tool calls"),
        (template("<call>{{ tc['name'] }} " + ARGS_JSON + "</call>"), "no vLLM tool-call parser matches"),
        ("{{ raise_exception('no tools here') }}", "does not render tools"),
    ],
)
def test_no_parser_says_why(chat_template, why):
    parser, reason = detect_tool_parser(tokenizer_with(chat_template), "torch")
    assert parser is None and why in reason


def test_resolution_and_startup_line():
    tokenizer = build_surface_tokenizer()
    resolved, line = resolve_tool_calling(InferenceConfig(), tokenizer, "torch")
    assert resolved.tool_parser == "hermes" and resolved.auto_tool_choice
    assert line.startswith("tool calling on: auto tool choice with the hermes tool-call parser")
    # vLLM's chat server gets its flags from the resolved config; the unresolved `auto` passes none
    assert vllm_cli_args(resolved)[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert "--tool-call-parser" not in vllm_cli_args(InferenceConfig())
    off, line = resolve_tool_calling(InferenceConfig(), build_chatml_tokenizer(CORPUS), "torch")
    assert off.tool_call_parser == "none" and not off.auto_tool_choice
    assert "tool calling off (the chat template does not render tools)" in line and "--tool-call-parser" in line
    manual = InferenceConfig(tool_call_parser="hermes", enable_auto_tool_choice=False)
    kept, line = resolve_tool_calling(manual, tokenizer, "torch")
    assert kept.tool_parser == "hermes" and not kept.auto_tool_choice and "required and named" in line
    assert "--enable-auto-tool-choice" not in vllm_cli_args(kept)


def test_parser_settings_are_checked_at_parse_time():
    with pytest.raises(ValueError, match="enable_auto_tool_choice requires a tool_call_parser"):
        InferenceConfig(tool_call_parser="none", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="the torch engine knows auto, none, hermes"):
        InferenceConfig(engine="torch", tool_call_parser="llama3_json")
    assert InferenceConfig(engine="vllm", tool_call_parser="llama3_json").tool_parser == "llama3_json"


def test_server_names_the_parser_at_start_and_the_settings_in_the_400(tmp_path, caplog):
    for chat_template, expected in ((QWEN3_STYLE_TEMPLATE, "hermes tool-call parser"), (None, "tool calling off")):
        tokenizer = build_surface_tokenizer()
        tokenizer.chat_template = chat_template or build_chatml_tokenizer(CORPUS).chat_template
        model_dir = tmp_path / expected.split()[0]
        tokenizer.save_pretrained(model_dir)
        engine = FixedTextEngine(tokenizer, lambda prompt: "Hello!")
        with caplog.at_level(logging.INFO, logger="prime_inference.app_common"):
            server = start_server(model_dir, engine_factory=lambda e=engine, t=tokenizer: (e, t))
        try:
            assert expected in caplog.text
            body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
            if chat_template is None:
                message = r.json()["error"]["message"]
                assert (
                    r.status_code == 400 and "--enable-auto-tool-choice" in message and "--tool-call-parser" in message
                )
            else:
                assert r.status_code == 200
        finally:
            server.stop()
