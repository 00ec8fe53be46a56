"""HTTP request schemas (OpenAI completions, vLLM token-in generate; chat in `prime_inference.chat_protocol`) and
engine-facing sampling params.

The OpenAI routes treat an unknown top-level field as vLLM does: ignored, with a warning in the log (once per field
name); nested objects and the token-in route forbid unknown fields. vLLM's own fields that this server does not
implement and that would change the output (``use_beam_search``, ``bad_words``, ...) are 400s when set, not ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, field_validator, model_validator

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MIN_TEMPERATURE = 0.01
"""vLLM raises a temperature in (0, 0.01) to 0.01 (below it, logits / temperature overflow)."""
logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A bad request: answered with an OpenAI-style JSON error and ``status_code``. ``permanent``: retrying cannot
    help until the server restarts (a dead engine); the answer carries ``prime_core.schemas.errors``' header."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, *, permanent: bool = False):
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param
        self.permanent = permanent


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
    structured_outputs: dict[str, Any] | None = None
    """The request's ``structured_outputs`` as vLLM reads it, once `grammar` compiled from it: the vLLM engine hands
    it to vLLM's own structured-output backend (its engine core compiles it), the torch engine follows `grammar`."""
    _derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """What an engine derives from these fields (an id tensor, an id set), made on the first token and kept for
        the others: rebuilding a vocabulary-sized ``allowed_token_ids`` tensor cost 46 ms per token on CPU."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Bool = Annotated[bool, Strict()]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]  # vLLM's [0, 2]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]


def _prompt_shape(value: Any) -> str | None:
    """Which of a completion prompt's four shapes ``value`` has, from its first element: one shape is validated, not
    all four (pydantic tried each, and a list of 5M token ids failed as a list of strings 5M times first: 8 s)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    if isinstance(first, str):
        return "texts"
    return "token_id_lists" if isinstance(first, list) else "token_ids"


CompletionPrompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[TokenId], Tag("token_ids")]
    | Annotated[list[list[TokenId]], Tag("token_id_lists")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_shape",
        custom_error_message="prompt must be a string, a list of strings, a list of token ids or a list of such lists",
    ),
]
"""Text, texts, one prompt's token ids, or several prompts' (the OpenAI completions API's four shapes)."""


def _check_top_k(v: int) -> int:
    if v < -1:
        raise ValueError("top_k must be -1 or 0 (disabled) or a positive integer")
    return v


def _check_stop(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else list(v)
    if len(stops) > MAX_STOP:
        raise ValueError(f"stop holds at most {MAX_STOP} strings, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop cannot contain an empty string")
    return stops


def _temperature(v: float | None) -> float:
    if v is None:
        return 1.0
    return MIN_TEMPERATURE if 0.0 < v < MIN_TEMPERATURE else v


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


_warned_fields: set[str] = set()


def warn_ignored(route: str, fields: set[str]) -> None:
    """vLLM's treatment of unknown request fields: ignored; logged once per field name (a client that always sends
    one must not flood the log), for a bounded number of names."""
    new = sorted(fields - _warned_fields)
    if new and len(_warned_fields) < 1024:
        _warned_fields.update(new)
        logger.warning("%s: ignored unknown request fields %s (as vLLM does)", route, new)


# vLLM request fields whose effect this server does not implement: a 400 when set to anything but their default.
REFUSED_FIELDS = ("use_beam_search", "bad_words", "truncate_prompt_tokens", "logprob_token_ids",
                  "return_tokens_as_token_ids", "priority")  # fmt: skip


class _OpenAISampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

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
    add_special_tokens: Bool | None = None
    """vLLM: special tokens (e.g. BOS) added when tokenizing the prompt; default false for chat (the template writes
    them), true for completions."""
    # OpenAI SDK fields, and vLLM fields without an effect here, that vLLM accepts and ignores.
    store: Bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    spaces_between_special_tokens: Bool = True
    # vLLM fields this server refuses when set (REFUSED_FIELDS).
    use_beam_search: Bool = False
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: Bool | None = None
    priority: int = 0

    @model_validator(mode="wrap")
    @classmethod
    def _ignore_unknown(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict) and (unknown := set(data) - set(cls.model_fields)):
            warn_ignored(cls.__name__, unknown)
        return handler(data)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        return None if v is None else _check_top_k(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        _check_stop(v)
        return v

    @field_validator(*REFUSED_FIELDS)
    @classmethod
    def _refused(cls, v: Any, info: Any) -> Any:
        if v not in (None, False, 0, []):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

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
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        temperature = _temperature(self.temperature)
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


class CompletionRequest(_OpenAISampling):
    prompt: CompletionPrompt
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
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        # A list of token ids is one prompt (vLLM's reading), however long.
        prompts = self.prompt if _prompt_shape(self.prompt) in ("texts", "token_id_lists") else [self.prompt]
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
            temperature=_temperature(sp.temperature),
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
