"""The chat completions request (vLLM 0.26's ``ChatCompletionRequest`` as this server serves it): messages, tools and
the chat-only options; the sampling fields are shared with completions (`prime_inference.protocol`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from prime_inference.protocol import MAX_TOP_LOGPROBS, Bool, _OpenAISampling, _Strict


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    """A ``data:image/...;base64,...`` URL or bare base64 (remote URLs are not fetched)."""
    detail: str | None = None


class ImageURLPart(_Strict):
    """OpenAI's image content part; only vision-language models accept it."""

    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(_Strict):
    """An assistant message's refusal part, as the SDK echoes it back."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImageURLPart | RefusalPart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # What the SDK echoes back from an assistant message; vLLM accepts and ignores them.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _null_content(self) -> ChatMessage:
        # vLLM's message types take an explicit null content only from the assistant (and the legacy function role).
        if "content" in self.model_fields_set and self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"content of a {self.role} message must be a string or a list of parts, not null")
        return self

    def image_urls(self) -> list[str]:
        return (
            [p.image_url.url for p in self.content if isinstance(p, ImageURLPart)]
            if isinstance(self.content, list)
            else []
        )

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: developer is system, tool-call arguments are objects, and the
        history's reasoning is ``reasoning_content`` (what Qwen3-style templates read)."""
        content = self.content
        if isinstance(content, list) and any(isinstance(p, ImageURLPart) for p in content):
            # VL chat templates render each image part as one placeholder; the server expands it afterwards.
            content = [p.model_dump(exclude_none=True) for p in content if not isinstance(p, RefusalPart)]
        elif isinstance(content, list):
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [_decoded_tool_call(c) for c in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


def _decoded_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its JSON ``arguments`` string decoded (templates iterate over them), as vLLM does."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # a policy's call echoed back: deep nesting, a >4300-digit int
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(_Strict):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema: an object (vLLM refuses anything else)."""
    strict: Bool | None = None


class ChatTool(_Strict):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: Bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: dict[str, Any] | None = None
    include_reasoning: Bool = True
    """vLLM: false drops ``reasoning`` from the response (the parser still separates it from ``content``)."""
    echo: Bool = False
    """vLLM: the answer's content starts with the last message's when that message has the answer's role (an
    assistant message continued with ``continue_final_message``, say); the prompt's log-probs come back too."""
    documents: list[dict[str, str]] | None = None
    """vLLM: documents handed to the chat template (RAG templates read them)."""
    chat_template: str | None = None
    """Refused, as vLLM refuses a request's own template unless the server trusts request templates."""
    thinking_token_budget: int | None = None
    """Refused: vLLM's reasoning budget is not implemented here."""
    # OpenAI SDK fields that vLLM accepts and ignores.
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
        for name in ("chat_template", "thinking_token_budget"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this server")
        if self.tools == []:
            raise ValueError("tools must not be an empty array: give at least one tool or leave the field out")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be none, auto, required or a named function")
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: when using tool_choice, tools must be set (as vLLM)")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
                raise ValueError('tool_choice: a named tool_choice is {"type": "function", "function": {"name": ...}}')
            if name not in self.tool_names():
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as vLLM hands them to the chat template (its model dump: unset fields None, an unset ``strict``
        left out), so both engines render the same prompt."""
        if self.tools is None:
            return None
        tools = [t.model_dump() for t in self.tools]
        for tool in tools:
            if tool["function"].get("strict") is None:
                tool["function"].pop("strict", None)
        return tools

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
