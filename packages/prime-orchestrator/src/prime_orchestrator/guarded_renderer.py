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

It plugs in through renderers' own ``custom`` renderer hook: ``prime_orchestrator.rendering`` wraps every renderer
the orchestrator configures, so no renderers code is patched and any renderer (a custom one too) is covered.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ConfigDict
from renderers.base import ParsedResponse, ToolCallParseStatus
from renderers.configs import BaseRendererConfig

logger = logging.getLogger("prime.orchestrator.renderer")

IMPORT_PATH = "prime_orchestrator.guarded_renderer.GuardedRenderer"


class GuardedRendererConfig(BaseRendererConfig):
    """renderers' typed config of ``GuardedRenderer``; extra fields are chat-template kwargs for the wrapped one."""

    model_config = ConfigDict(frozen=True, extra="allow")

    renderer: dict[str, Any]
    """The wrapped renderer's ``renderers.RendererConfig`` data (``{"name": "qwen3"}``, ...)."""

    _internal_fields = frozenset({"renderer"})
    # The wrapped renderer validates the template kwargs against its own allowlist when it is built.
    _allow_opaque_template_kwargs = True


def guarded(renderer: dict[str, Any]) -> dict[str, Any]:
    """The ``renderers.RendererConfig`` data of ``renderer`` wrapped in ``GuardedRenderer``."""
    return {"name": "custom", "import_path": IMPORT_PATH, "renderer": renderer}


class GuardedRenderer:
    """The wrapped renderer, whose ``parse_response`` returns a completion it cannot parse as plain content."""

    config_class = GuardedRendererConfig

    def __init__(self, tokenizer: Any, config: GuardedRendererConfig):
        from pydantic import TypeAdapter
        from renderers import RendererConfig, create_renderer
        from renderers.base import is_multimodal

        inner_config = TypeAdapter(RendererConfig).validate_python(config.renderer)
        self.inner = create_renderer(tokenizer, inner_config, chat_template_kwargs=config.model_extra or None)
        self.tokenizer = tokenizer
        # renderers caches is_multimodal per type: answer per instance, for text and vision renderers alike.
        self.is_multimodal = is_multimodal(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def parse_response(self, token_ids: list[int], **kwargs: Any) -> ParsedResponse:
        try:
            parsed = self.inner.parse_response(token_ids, **kwargs)
            for call in parsed.tool_calls:
                if call.status == ToolCallParseStatus.OK:
                    # Lone surrogates: UnicodeEncodeError, a ValueError like the parsers' own failures.
                    json.dumps([call.name, call.arguments], ensure_ascii=False).encode()
            return parsed
        except (RecursionError, ValueError) as e:
            logger.warning(
                "%s: a completion's tool call does not parse (%s: %.200s); it is content with no tool call",
                type(self.inner).__name__,
                type(e).__name__,
                e,
            )
        return ParsedResponse(content=self._text(token_ids), reasoning_content=None, reasoning_complete=None)

    def _text(self, token_ids: list[int]) -> str:
        """The completion's text up to its first stop token, as the renderers' parsers cut it."""
        stops = set(self.inner.get_stop_token_ids())
        ids = list(token_ids)
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        return self.tokenizer.decode(ids[:end], skip_special_tokens=False) if end else ""
