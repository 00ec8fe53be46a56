"""Reasoning and tool calls out of a chat completion, as vLLM 0.26's chat server splits them.

Tool calls: the torch engine serves vLLM's parser names (``--tool-call-parser hermes``) by wrapping the parser of
`renderers` (verifiers' rendering library) for the same format (`prime_core.config.inference.TORCH_TOOL_PARSERS`);
the content before the first call block stays ``content`` (None when blank), and every block must parse, else there
are no tool calls and the whole text is content (vLLM's hermes parser does the same).

Reasoning, by vLLM 0.26's parsers (their semantics differ from `renderers`' think parser, so they are written here):

* ``qwen3``: unless the request's ``chat_template_kwargs.enable_thinking`` is false, the output starts in reasoning
  (the chat template may have opened the think block): ``<think>`` is dropped, ``</think>`` ends it, and so does a
  ``<tool_call>``, which stays in the content; output without either is all reasoning and ``content`` is None;
* ``deepseek_r1``: what follows ``<think>`` (or the whole output) is reasoning up to ``</think>``, the rest content.

Forced tool calls (``tool_choice`` required or named): vLLM 0.26 constrains them to the parser's own syntax
(`FORCED_CALL_SYNTAX`, its structural tag for hermes) and reads them back with the parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from prime_core.config.inference import TORCH_TOOL_PARSERS

THINK_START, THINK_END, TOOL_CALL_START = "<think>", "</think>", "<tool_call>"
_QWEN3_MARKERS = re.compile(f"({re.escape(THINK_START)}|{re.escape(THINK_END)}|{re.escape(TOOL_CALL_START)})")
REASONING_MARKERS = (THINK_START, THINK_END, TOOL_CALL_START)

# vLLM's hermes structural tag: each call is one of these (text before and after the arguments' JSON).
FORCED_CALL_SYNTAX = {
    "hermes": (
        ('<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"),
        ('<tool_call>{"name": "{name}", "arguments": ', "}</tool_call>"),
    ),
}
FORCED_CALL_MARKERS = ("<tool_call>", "</tool_call>")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call; ``arguments`` become the JSON string clients decode."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def qwen3_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """vLLM 0.26's ``qwen3`` reasoning parser (its parser engine's reasoning pass)."""
    if not thinking:
        return None, text
    reasoning, content, in_reasoning = [], [], True
    for piece in _QWEN3_MARKERS.split(text):
        if in_reasoning:
            if piece == THINK_START:
                continue
            if piece in (THINK_END, TOOL_CALL_START):
                in_reasoning = False
                if piece == TOOL_CALL_START:
                    content.append(piece)
                continue
            reasoning.append(piece)
        elif piece != THINK_END:  # a second </think> is dropped
            content.append(piece)
    return "".join(reasoning) or None, "".join(content) or None


def deepseek_r1_reasoning(text: str) -> tuple[str | None, str | None]:
    """vLLM 0.26's ``deepseek_r1`` parser: reasoning from the start (or after ``<think>``) up to ``</think>``."""
    head, start, tail = text.partition(THINK_START)
    text = tail if start else head
    if THINK_END not in text:
        return text, None
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content or None


def _hold_back(text: str, markers: tuple[str, ...]) -> str:
    """While streaming: the text without a tail that may still grow into a marker (it is sent once it cannot)."""
    for cut in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text


@dataclass
class ParsedOutput:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class OutputParser:
    """Splits one completion into reasoning, content and tool calls; built once per server."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None, reasoning_parser: str | None):
        from renderers.parsers import get_tool_parser

        self.tokenizer = tokenizer
        self.tool_format = tool_call_parser
        self.tools = get_tool_parser(TORCH_TOOL_PARSERS[tool_call_parser], tokenizer) if tool_call_parser else None
        self.reasoning_parser = reasoning_parser

    def split_reasoning(self, text: str, thinking: bool, final: bool) -> tuple[str | None, str | None]:
        if self.reasoning_parser is None:
            return None, text
        if not final:
            text = _hold_back(text, REASONING_MARKERS)
        if self.reasoning_parser == "qwen3":
            return qwen3_reasoning(text, thinking)
        return deepseek_r1_reasoning(text)

    def parse(self, token_ids: list[int], text: str, parse_tools: bool, skip_special: bool = True,
              final: bool = True, thinking: bool = True) -> ParsedOutput:  # fmt: skip
        """``text`` is the decoded (stop-string cut) completion; ``token_ids`` what the tool parser reads. While
        streaming (``final`` False) a block that is still open holds back: the calls so far, nothing after them."""
        if not parse_tools or self.tools is None:
            reasoning, content = self.split_reasoning(text, thinking, final)
            return ParsedOutput(content, reasoning)
        try:
            content_ids, calls = self.tools.extract(list(token_ids))
        except (RecursionError, ValueError):  # json.loads on deep nesting or a >4300-digit int: not a call
            content_ids, calls = [], None
        held = not final and bool(calls) and calls[-1].status.name == "UNCLOSED_BLOCK"
        ok = [_openai_call(c) for c in (calls[:-1] if held else calls or [])]
        if not held and (not calls or None in ok):
            reasoning, content = self.split_reasoning(text, thinking, final)
            return ParsedOutput(content, reasoning)
        ok = [c for c in ok if c is not None]
        head = self.tokenizer.decode(content_ids, skip_special_tokens=skip_special)
        reasoning, content = self.split_reasoning(head, thinking, final=True)
        if ok and content is not None and not content.strip():
            content = None  # vLLM: blank content before the calls is no content
        return ParsedOutput(content, reasoning, ok)


def _openai_call(call: Any) -> dict[str, Any] | None:
    """A parsed call as OpenAI's, or None where it cannot be one: its name is not a string (vLLM's parser refuses it
    too), or a JSON escape decoded to a lone surrogate, which no UTF-8 response can carry (the whole answer was a
    500). Arguments are always encoded as JSON, a string too, as vLLM does, so clients can decode them."""
    if call.status.name != "OK" or not isinstance(call.name, str):
        return None
    out = tool_call(call.name, json.dumps(call.arguments, ensure_ascii=False), call.id)
    try:
        call.name.encode()
        out["function"]["arguments"].encode()
    except UnicodeEncodeError:
        return None
    return out


def forced_tool_calls(text: str, tool_choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    """Tool calls of a ``required`` or named ``tool_choice`` constrained to vLLM's JSON form (parsers without a
    forced-call syntax here): a named function's arguments, or a JSON array of ``{"name", "parameters"}``."""
    if isinstance(tool_choice, dict):
        return [tool_call(tool_choice["function"]["name"], text)] if text.strip() else []
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens: the JSON never closed
    if not isinstance(calls, list):
        return []
    return [tool_call(c["name"], c.get("parameters", {})) for c in calls if isinstance(c, dict) and "name" in c]
