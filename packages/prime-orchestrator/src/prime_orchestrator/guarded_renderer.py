"""A renderer whose parse of a completion never raises on the policy's text: what it cannot parse is content.

renderers' JSON tool parsers (``parse_qwen3``, ``Qwen3ToolParser``, and others alike) catch ``json.JSONDecodeError``
only. A ``<tool_call>`` whose arguments nest 20k deep (``RecursionError``) or hold a 5000-digit integer
(``ValueError``: CPython's int-string limit) raised out of ``parse_response`` inside verifiers' interception server,
and the rollout failed (never trained on) where any other malformed call is scored. vLLM's parsers answer such a
completion with its whole text as content and no tool call; so does this renderer, as our chat route does
(``prime_inference.chat_parsing``).

A call that parses but whose name or arguments hold a lone surrogate (the JSON escape ``"\\ud800"``) is no call
either: no UTF-8 encoder takes it, and the MCP client's request writer (httpx2's ``json=``) raised on it, closed the
connection, and verifiers' retries (6 attempts, ~20 s) ended the rollout with ``MCPError: Connection closed``. vLLM's
response encoder refuses it too, so our chat route answers the same completion as content.

It plugs in through renderers' own ``custom`` renderer hook: ``prime_orchestrator.rendering`` names it for every
renderer the orchestrator configures, and it builds that renderer and guards the ``parse_response`` of that one
instance, so no renderers code is patched and any renderer (a custom one too) is covered.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ConfigDict
from renderers.base import ParsedResponse, ToolCallParseStatus
from renderers.configs import BaseRendererConfig

logger = logging.getLogger("prime.orchestrator.renderer")

IMPORT_PATH = "prime_orchestrator.guarded_renderer.guarded_renderer"


class GuardedRendererConfig(BaseRendererConfig):
    """renderers' typed config of ``guarded_renderer``; extra fields are chat-template kwargs for the wrapped one."""

    model_config = ConfigDict(frozen=True, extra="allow")

    renderer: dict[str, Any]
    """The wrapped renderer's ``renderers.RendererConfig`` data (``{"name": "qwen3"}``, ...)."""

    _internal_fields = frozenset({"renderer"})
    # The wrapped renderer validates the template kwargs against its own allowlist when it is built.
    _allow_opaque_template_kwargs = True


def guarded(renderer: dict[str, Any]) -> dict[str, Any]:
    """The ``renderers.RendererConfig`` data of ``renderer`` with its parse guarded."""
    return {"name": "custom", "import_path": IMPORT_PATH, "renderer": renderer}


def guarded_renderer(tokenizer: Any, config: GuardedRendererConfig) -> Any:
    """renderers' custom-renderer constructor: the wrapped renderer itself, whose ``parse_response`` (on this
    instance only) returns a completion it cannot parse as plain content. The renderer keeps its own type, which
    renderers dispatches on (multimodal features), and its own calls of ``self.parse_response`` (GLM's and
    DeepSeek's bridges) are guarded too."""
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    from prime_orchestrator.plain_content import PlainContentTokenizer, plain_content
    from prime_orchestrator.prompt_bound import bound_prompts
    from prime_orchestrator.worker_tuning import memoise_short_encodes

    memoise_short_encodes(tokenizer)  # renderers re-encodes its headers and probes on every turn
    inner_config = TypeAdapter(RendererConfig).validate_python(config.renderer)
    plain = PlainContentTokenizer(tokenizer)
    renderer = create_renderer(plain, inner_config, chat_template_kwargs=config.model_extra or None)
    plain_content(renderer, plain)  # special-token text in messages (a tool's output) is plain text
    bound_prompts(renderer, tokenizer, str(getattr(tokenizer, "name_or_path", "")))  # refused before tokenizing
    parse = renderer.parse_response

    def parse_response(token_ids: list[int], **kwargs: Any) -> ParsedResponse:
        try:
            parsed = parse(token_ids, **kwargs)
            for call in parsed.tool_calls:
                if call.status == ToolCallParseStatus.OK:
                    # Lone surrogates: UnicodeEncodeError, a ValueError like the parsers' own failures.
                    json.dumps([call.name, call.arguments], ensure_ascii=False).encode()
            return parsed
        except (RecursionError, ValueError) as e:
            logger.warning(
                "%s: a completion's tool call does not parse (%s: %.200s); it is content with no tool call",
                type(renderer).__name__,
                type(e).__name__,
                e,
            )
        # The text up to the first stop token, as renderers' parsers cut it.
        stops = set(renderer.get_stop_token_ids())
        end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        text = tokenizer.decode(list(token_ids[:end]), skip_special_tokens=False) if end else ""
        return ParsedResponse(content=text, reasoning_content=None, reasoning_complete=None)

    renderer.parse_response = parse_response
    return renderer


guarded_renderer.config_class = GuardedRendererConfig  # what renderers' custom hook reads
