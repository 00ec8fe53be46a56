"""HTTP request schemas (OpenAI chat/completions, vLLM token-in generate) and engine-facing sampling params.

Every request model forbids unknown fields, so a typo is a 400 rather than a silently ignored option. Options that
vLLM accepts but the server does not implement are accepted at their neutral value and rejected otherwise.
"""

from __future__ import annotations

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
    """What an engine needs to generate one sequence (one choice)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k (vLLM's convention)."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    """None: no log-probs; k >= 0: the sampled token's log-prob plus the top k alternatives."""
    include_stop_str_in_output: bool = False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Bool = Annotated[bool, Strict()]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


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


def _neutral(name: str, value: Any, neutral: Any) -> None:
    if value is not None and value != neutral:
        raise ValueError(f"{name}={value!r} is not supported by this server (only {neutral!r})")


class _OpenAISampling(_Strict):
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: Bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: Bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    return_token_ids: Bool = False
    """vLLM extension: include ``prompt_token_ids`` and per-choice ``token_ids`` in the response."""

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
    def _unsupported(self) -> _OpenAISampling:
        _neutral("presence_penalty", self.presence_penalty, 0.0)
        _neutral("frequency_penalty", self.frequency_penalty, 0.0)
        _neutral("repetition_penalty", self.repetition_penalty, 1.0)
        _neutral("min_p", self.min_p, 0.0)
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        _check_stop(self.stop)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=_check_stop(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    def image_urls(self) -> list[str]:
        return (
            [p.image_url.url for p in self.content if isinstance(p, ImageURLPart)]
            if isinstance(self.content, list)
            else []
        )

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list) and any(isinstance(p, ImageURLPart) for p in content):
            # VL chat templates render each image part as one placeholder; the server expands it afterwards.
            content = [p.model_dump(exclude_none=True) for p in content]
        elif isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


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

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are mutually exclusive")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice other than none/auto is not supported by this server")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
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
    min_p: float = 0.0
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: Bool = False
    max_tokens: int | None = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = 1.0
    detokenize: Bool = True
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
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
        _neutral("presence_penalty", self.presence_penalty, 0.0)
        _neutral("frequency_penalty", self.frequency_penalty, 0.0)
        _neutral("repetition_penalty", self.repetition_penalty, 1.0)
        _neutral("min_p", self.min_p, 0.0)
        _neutral("prompt_logprobs", self.prompt_logprobs, None)
        for name in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server")
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
    """Sent by verifiers' renderer client for text-only prompts; text is already in ``token_ids``."""
    images: list[str] | None = None
    """prime extension for vision-language models: the prompt's images (data: URLs or base64), in order;
    ``token_ids`` must hold each one's full placeholder run (as the chat route returns in ``prompt_token_ids``)."""
    return_token_ids: Bool = False
    """Accepted for the renderer client; ``prompt_token_ids`` is always returned."""

    @model_validator(mode="after")
    def _generate_checks(self) -> GenerateRequest:
        if self.features:
            raise ValueError("multimodal features are not supported by this server")
        if self.priority != 0:
            raise ValueError("priority scheduling is not enabled on this server")
        if self.kv_transfer_params or self.ec_transfer_params:
            raise ValueError("disaggregated serving parameters are not supported by this server")
        return self

    def sampling(self, max_tokens: int) -> SamplingParams:
        sp = self.sampling_params
        logprobs = None if sp.logprobs is None else max(sp.logprobs, 0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=sp.seed,
            stop=_check_stop(sp.stop),
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )


class AdminOk(BaseModel):
    status: str
