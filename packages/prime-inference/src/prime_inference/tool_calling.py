"""Tool calling on by default where it can work: ``tool_call_parser = "auto"`` finds the vLLM tool-call parser that
matches how the served model's chat template writes tool calls, and the server starts with auto tool choice on.

The template is asked, not read: it renders a probe tool (does it show tools at all?) and an assistant turn that
calls it, and the rendered call is matched against the formats of vLLM's parsers (hermes' ``<tool_call>{json}``,
Qwen3-Coder's ``<function=..>``, GLM's ``<arg_key>``, DeepSeek's ``<｜tool▁call▁begin｜>``, ...). The torch engine parses
the formats in `prime_core.config.inference.TORCH_TOOL_PARSERS`; the vLLM engine any parser vLLM has.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prime_core.config.inference import TORCH_TOOL_PARSERS, InferenceConfig

logger = logging.getLogger(__name__)

PROBE_NAME = "prime_probe_lookup"
PROBE_ARG, PROBE_VALUE = "prime_probe_arg", "prime_probe_value"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "Looks a value up.",
        "parameters": {"type": "object", "properties": {PROBE_ARG: {"type": "string"}}, "required": [PROBE_ARG]},
    },
}
PROBE_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": PROBE_NAME, "arguments": {PROBE_ARG: PROBE_VALUE}},
}

_N = re.escape(PROBE_NAME)
# (vLLM parser, pattern of the rendered call); first match wins, so the more specific formats come first.
CALL_FORMATS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.DOTALL))
    for name, pattern in (
        ("qwen3_coder", rf"<tool_call>\s*<function={_N}>"),
        ("glm47", rf"<tool_call>{_N}<arg_key>"),
        ("glm45", rf"<tool_call>{_N}\s+<arg_key>"),
        ("hermes", rf"<tool_call>\s*\{{\s*\"name\"\s*:\s*\"{_N}\"\s*,\s*\"arguments\""),
        ("deepseek_v3", rf"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{_N}"),
        ("deepseek_v31", rf"<｜tool▁call▁begin｜>{_N}<｜tool▁sep｜>"),
        ("kimi_k2", rf"<\|tool_call_begin\|>\s*functions\.{_N}"),
        ("minimax_m2", rf"<minimax:tool_call>\s*<invoke name=\"{_N}\">"),
        ("mistral", rf"\[TOOL_CALLS\]\s*(\[\s*\{{\s*\"name\"\s*:\s*\"{_N}\"|{_N}\[ARGS\])"),
        ("llama3_json", rf"\{{\s*\"name\"\s*:\s*\"{_N}\"\s*,\s*\"parameters\""),
    )
)
# What the torch engine's parsers read as single tokens (renderers' parsers match token ids).
_TC = ("<tool_call>", "</tool_call>")
_GLM = (*_TC, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
MARKER_TOKENS = {
    "hermes": _TC,
    "qwen3_coder": _TC,
    "qwen3_xml": _TC,
    "glm45": _GLM,
    "glm47": _GLM,
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    ),
}


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], tokenize=False, **kwargs)
    except Exception:  # templates raise on inputs they do not take (jinja errors, raise_exception)
        return None


def _is_token(tokenizer: Any, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1


def detect_tool_parser(tokenizer: Any, engine: str) -> tuple[str | None, str]:
    """(vLLM parser name or None, why): the parser for the tool calls this tokenizer's chat template writes."""
    if not getattr(tokenizer, "chat_template", None):
        return None, "the tokenizer has no chat template"
    user = [{"role": "user", "content": "Look the value up."}]
    shown = _render(tokenizer, user, add_generation_prompt=True)
    if shown is None or PROBE_NAME not in shown:
        return None, "the chat template does not render tools"
    called = _render(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}])
    if called is None or PROBE_VALUE not in called:
        return None, "the chat template renders tools but not an assistant's tool calls"
    parser = next((name for name, pattern in CALL_FORMATS if pattern.search(called)), None)
    if parser is None:
        return None, "no vLLM tool-call parser matches how the chat template writes tool calls"
    if engine != "vllm":  # our engines parse with renderers' parsers
        if parser not in TORCH_TOOL_PARSERS:
            return None, f"the chat template writes {parser} tool calls, which the torch engine does not parse"
        missing = [m for m in MARKER_TOKENS[parser] if not _is_token(tokenizer, m)]
        if missing:
            return None, f"the chat template writes {parser} tool calls, but {' and '.join(missing)} are not tokens"
    return parser, "matches the chat template"


def resolve_tool_calling(config: InferenceConfig, tokenizer: Any, engine: str) -> tuple[InferenceConfig, str]:
    """The config with ``tool_call_parser`` made explicit (a parser name or ``none``), and the startup line."""
    why = "set by tool_call_parser"
    if config.tool_call_parser == "auto":
        try:
            parser, why = detect_tool_parser(tokenizer, engine)
        except Exception as e:  # a broken template must not stop the server: tools are then off, and the line says why
            parser, why = None, f"the chat template failed: {type(e).__name__}: {e}"
        config = config.model_copy(update={"tool_call_parser": parser or "none"})
    if config.tool_parser is None:
        line = (
            f"tool calling off ({why}): requests with tools get a 400; set --tool-call-parser NAME "
            "(and --enable-auto-tool-choice) to turn it on"
        )
    elif config.auto_tool_choice:
        line = f"tool calling on: auto tool choice with the {config.tool_parser} tool-call parser ({why})"
    else:
        line = (
            f"tool calling: the {config.tool_parser} parser reads required and named tool choices only "
            "(enable_auto_tool_choice is false)"
        )
    return config, line


def no_parser_hint(config: InferenceConfig) -> str:
    """What a 400 for tools without a parser adds to vLLM's message: the two settings, as this server's config."""
    if config.tool_parser is None:
        return " (this server: tool_call_parser=none; start it with --tool-call-parser NAME --enable-auto-tool-choice)"
    return " (this server: enable_auto_tool_choice=false; start it with --enable-auto-tool-choice)"
