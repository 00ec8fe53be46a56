"""Reasoning and tool calls out of a chat completion, with the parsers of `renderers` (verifiers' rendering library).

The torch engine serves vLLM's flags (``--tool-call-parser hermes --reasoning-parser qwen3``) by wrapping the
`renderers` parser for the same format (`prime_core.config.inference.TORCH_TOOL_PARSERS`); the vLLM engine uses
vLLM's own parsers. Semantics, as vLLM's chat server applies them:

* reasoning: text that starts with ``<think>`` is reasoning up to ``</think>`` (all of it while unclosed), the rest
  is content; text without ``<think>`` is all content (renderers' ``think`` parser);
* tool calls: the content before the first tool-call block stays ``content`` (None when empty); every block must
  parse, else there are no tool calls and the whole text is content (vLLM's hermes parser does the same).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from prime_core.config.inference import TORCH_REASONING_PARSERS, TORCH_TOOL_PARSERS


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call; ``arguments`` become the JSON string clients decode."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ParsedOutput:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class OutputParser:
    """Splits one completion into reasoning, content and tool calls; built once per server."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None, reasoning_parser: str | None):
        from renderers.parsers import get_reasoning_parser, get_tool_parser

        self.tokenizer = tokenizer
        self.tools = get_tool_parser(TORCH_TOOL_PARSERS[tool_call_parser], tokenizer) if tool_call_parser else None
        self.reasoning = (
            get_reasoning_parser(TORCH_REASONING_PARSERS[reasoning_parser], tokenizer) if reasoning_parser else None
        )

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.extract(text)

    def parse(
        self, token_ids: list[int], text: str, parse_tools: bool, skip_special: bool = True, final: bool = True
    ) -> ParsedOutput:
        """``text`` is the decoded (stop-string cut) completion; ``token_ids`` what the tool parser reads. While
        streaming (``final`` False) a block that is still open holds back: the calls so far, nothing after them."""
        if not parse_tools or self.tools is None:
            reasoning, content = self.split_reasoning(text)
            return ParsedOutput(content, reasoning)
        content_ids, calls = self.tools.extract(list(token_ids))
        if not final and calls and calls[-1].status.name == "UNCLOSED_BLOCK":
            calls = calls[:-1]
        elif not calls or any(c.status.name != "OK" for c in calls):
            reasoning, content = self.split_reasoning(text)
            return ParsedOutput(content, reasoning)
        head = self.tokenizer.decode(content_ids, skip_special_tokens=skip_special)
        reasoning, content = self.split_reasoning(head)
        ok = [tool_call(c.name, c.arguments, c.id) for c in calls if c.status.name == "OK"]
        return ParsedOutput(content or None, reasoning, ok)


def forced_tool_calls(text: str, tool_choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    """Tool calls of a ``required`` or named ``tool_choice``, whose output the grammar made JSON (vLLM's format)."""
    if isinstance(tool_choice, dict):
        return [tool_call(tool_choice["function"]["name"], text)]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens: the JSON never closed
    return [tool_call(c["name"], c.get("parameters", {})) for c in calls if isinstance(c, dict) and "name" in c]
