"""HTTP request schemas (OpenAI chat/completions, vLLM token-in generate) and engine-facing sampling params.

Every request model forbids unknown fields, so a typo is a 400 rather than a silently ignored option; the OpenAI SDK
fields that vLLM accepts and ignores (``store``, ``metadata``, ``reasoning_effort``, ...) are declared and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

MAX_N = 64
MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A bad request: answered with an OpenAI-style JSON error and ``status_code``."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        409: "ConflictError",
        413: "RequestTooLarge",
        415: "UnsupportedMediaType",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }.get(status_code, "InternalServerError" if status_code >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


@dataclass
class SamplingParams:
    """What an engine needs to generate one sequence (one choice). Processing order follows vLLM's sampler: grammar
    mask, allowed ids, logit bias and min_tokens bans, penalties, then temperature, min_p, top-k and top-p."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k (vLLM's convention)."""
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    """None: no log-probs; k >= 0: the sampled token's log-prob plus the top k alternatives."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: every prompt token's log-prob plus the top k alternatives at its position."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    grammar: str | None = None
    """An llguidance grammar (built by `prime_inference.structured`) that every sampled token must follow."""

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Bool = Annotated[bool, Strict()]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]


def _check_top_k(v: int) -> int:
    if v < -1:
        raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer")
    return v


def _check_stop(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else list(v)
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` as ids, each bias clamped to [-100, 100] as vLLM does."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = min(100.0, max(-100.0, float(value)))
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
    return out


def check_greedy_n(n: int, temperature: float) -> None:
    if n > 1 and temperature == 0:
        raise RequestError(f"n must be 1 when using greedy sampling, got {n}.", param="n")


class _OpenAISampling(_Strict):
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: MinP | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: Bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    user: str | None = None
    ignore_eos: Bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    return_token_ids: Bool = False
    """vLLM extension: include ``prompt_token_ids`` and per-choice ``token_ids`` in the response."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` (see `prime_inference.structured`)."""
    # OpenAI SDK fields that vLLM accepts and ignores.
    store: Bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        return None if v is None else _check_top_k(v)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            unknown = set(v) - {"include_usage", "continuous_usage_stats"}
            if unknown:
                raise ValueError(f"unknown stream_options {sorted(unknown)}")
            if any(not isinstance(x, bool) for x in v.values()):
                raise ValueError("stream_options values must be booleans")
        return v

    @model_validator(mode="after")
    def _checks(self) -> _OpenAISampling:
        _check_stop(self.stop)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        check_greedy_n(self.n, temperature)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=_check_stop(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=None if self.prompt_logprobs is None else max(self.prompt_logprobs, 0),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=logit_bias_ids(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
        )


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
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: Bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: dict[str, Any] | None = None
    include_reasoning: Bool = True
    """vLLM: false drops ``reasoning`` from the response (the parser still separates it from ``content``)."""
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
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError("tool_choice must be none, auto, required or a named function")
        if choice is not None and choice != "none" and choice != "auto" and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
            if name not in self.tool_names():
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return self

    def tool_names(self) -> list[str]:
        return [(t.get("function") or {}).get("name") for t in self.tools or []]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Bool = False
    """Prepend the prompt to the text (and, with ``logprobs``, its tokens' log-probs), as vLLM does."""
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    """Accepted and ignored, as vLLM 0.26 does."""
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server (nor by vLLM)")
        prompts = self.prompt if isinstance(self.prompt, list) else [self.prompt]
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) * self.n > MAX_N:
            raise ValueError(f"number of prompts times n must be at most {MAX_N}")
        return self


class GenerateSamplingParams(_Strict):
    """vLLM 0.26 ``SamplingParams`` fields as the JSON of ``/inference/v1/generate`` carries them."""

    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = 0
    min_p: MinP = 0.0
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: Bool = False
    max_tokens: int | None = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    detokenize: Bool = True
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    flat_logprobs: Bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        return _check_top_k(v)

    @model_validator(mode="after")
    def _unsupported(self) -> GenerateSamplingParams:
        if self.bad_words:
            raise ValueError("bad_words is not supported by this server")
        _check_stop(self.stop)
        return self


class GenerateRequest(_Strict):
    """vLLM 0.26 ``/inference/v1/generate``: prompt token ids in, completion token ids and log-probs out."""

    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    request_id: str | None = Field(default=None, max_length=256)
    stream: Bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    """The prompt's media in order, as renderers' token-in client sends them for a vision-language model:
    ``token_ids`` holds one placeholder token per image, which the server expands (returned as
    ``prompt_token_ids``, with ``mm_placeholders``) as vLLM does."""
    images: list[str] | None = None
    """prime extension for vision-language models: the prompt's images (data: URLs or base64), in order;
    ``token_ids`` must hold each one's full placeholder run (as the chat route returns in ``prompt_token_ids``)."""
    return_token_ids: Bool = False
    """Accepted for the renderer client; ``prompt_token_ids`` is always returned."""

    @model_validator(mode="after")
    def _generate_checks(self) -> GenerateRequest:
        if self.features:
            raise ValueError("multimodal features are not supported by this server (send content_parts)")
        if self.images and self.content_parts:
            raise ValueError("give the images as images or as content_parts, not both")
        if self.priority != 0:
            raise ValueError("priority scheduling is not enabled on this server")
        if self.kv_transfer_params or self.ec_transfer_params:
            raise ValueError("disaggregated serving parameters are not supported by this server")
        return self

    def sampling(self, max_tokens: int) -> SamplingParams:
        sp = self.sampling_params
        check_greedy_n(sp.n, sp.temperature)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.seed,
            stop=_check_stop(sp.stop),
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_tokens,
            logprobs=None if sp.logprobs is None else max(sp.logprobs, 0),
            prompt_logprobs=None if sp.prompt_logprobs is None else max(sp.prompt_logprobs, 0),
            include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=logit_bias_ids(sp.logit_bias),
            allowed_token_ids=sp.allowed_token_ids,
        )
