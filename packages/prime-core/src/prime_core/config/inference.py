"""Config of the ``inference`` process: an OpenAI-compatible server on the vLLM or the PyTorch engine."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_core.config.base import BaseConfig
from prime_core.config.shared import MAX_BATCH, MAX_SEQ_LEN, LogConfig, ModelConfig, Seed, default_run_dir

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerConfig(BaseConfig):
    """HTTP server: address, authentication and where weight updates may be read from."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback requires ``weight_roots`` (and should set ``api_key``)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    api_key: str | None = None
    """When set, every route requires ``Authorization: Bearer <api_key>``."""
    api_key_var: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of an environment variable holding the API key (used when ``api_key`` is unset): the key stays out of
    the config files written into the run directory. A named variable that is unset or empty stops the server at
    start, so a server meant to require a key never serves without one."""
    weight_roots: list[Path] = Field(default_factory=list)
    """Directories that ``/update_weights`` may read from (a ``weight_dir`` must resolve inside one). Empty
    allows any directory, which is only accepted on a loopback host."""
    served_model_name: str | None = None
    """Model name reported by ``/v1/models`` and accepted in requests; defaults to ``model.name``."""
    timeout_keep_alive: int = Field(default=30, ge=1)
    """Seconds an idle HTTP keep-alive connection stays open, and seconds a client has to send each whole request
    (headers and body) after connecting or after its previous response: slower connections are closed."""
    shutdown_timeout: float = Field(default=10.0, gt=0)
    """On SIGTERM or Ctrl-C: seconds running requests may take to finish before they are cut (a request waiting on
    a paused engine, or a client that stops reading a stream, would otherwise hold the exit forever)."""
    weight_wait_timeout: float = Field(default=1800.0, gt=0)
    """Seconds a token-in request that names the oldest weights it accepts (``extra_args.prime_min_weight_step``, the
    orchestrator's ``dispatch_ahead``) waits for them; then it answers 503 naming the step it waited for."""
    max_buffered_body_bytes: int = Field(default=1024**3, ge=64 * 1024**2)
    """Bytes of request bodies the server holds at once while receiving them, all clients together (each body is also
    at most 64 MiB, a 413 past that). A request arriving past it is a 503 to retry: without it, a few hundred clients
    sending large bodies slowly held gigabytes until the server was killed for memory. Bodies are held only until
    parsed, so normal traffic stays far below; raise it for many concurrent requests with large images."""
    frozen: bool = False
    """Refuse every weight change (``/update_weights``, ``/reload_weights``, LoRA adapter loads) with 403: a
    distillation teacher keeps the weights it started with (``rl`` sets it for the teacher it starts)."""

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the value of the variable ``api_key_var`` names; ``ValueError`` when that is unset."""
        import os

        if self.api_key is not None or self.api_key_var is None:
            return self.api_key
        if not os.environ.get(self.api_key_var):
            raise ValueError(f"server.api_key_var: the environment variable {self.api_key_var} is unset or empty")
        return os.environ[self.api_key_var]


class TorchEngineConfig(BaseConfig):
    """The embedded PyTorch engine (CPU or a single GPU): continuous batching over a slotted KV cache."""

    device: str = "auto"
    """Torch device: auto is cuda when available, else cpu."""
    attn: Literal["sdpa"] = "sdpa"
    """Attention backend of the prefill and decode kernels."""
    num_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads on CPU; unset keeps torch's default."""


class VllmConfig(BaseConfig):
    """Options passed through to vLLM's engine (``vllm serve`` flag names, snake_case)."""

    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use for weights, activations and KV cache. ``rl`` replaces it with
    ``devices.inference_memory_fraction`` when inference and trainer share a GPU."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel degree."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Data-parallel replicas behind this server."""
    data_parallel_size_local: int | None = Field(default=None, ge=1)
    """Data-parallel replicas on this node (multi-node DP)."""
    data_parallel_address: str | None = None
    """Address of the data-parallel head node (multi-node DP)."""
    data_parallel_rpc_port: int | None = Field(default=None, ge=1, le=65535)
    """RPC port of the data-parallel head node (multi-node DP)."""
    engines: int = Field(default=1, ge=1, le=8)
    """vLLM engines this server runs on the same GPUs, each with ``1/engines`` of ``gpu_memory_utilization``, its own
    copy of the weights and its share of the requests (a group's samples on one engine). For small models on one GPU,
    where one engine's host loop, not the GPU, bounds generation: on one H200 two engines generated the RL loop's 512
    rollouts of Qwen3-0.6B 1.61x faster (docs/inference.md#several-engines-on-one-gpu). Each engine has its own prefix
    cache; vLLM's own OpenAI routes use the first. Needs ``data_parallel_size = 1``."""
    headless: bool = False
    """Run engine cores only, without an API server (secondary DP nodes)."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    log_stats: bool = False
    """vLLM's per-step engine statistics (its Prometheus ``/metrics`` and periodic throughput log lines). Off by
    default, unlike ``vllm serve``: on H100s the server ran 28-37% faster without them (docs/benchmarks.md)."""
    fast_token_logprobs: bool = True
    """Sampled-token log-probs (``logprobs`` 0 or 1 on the token-in route, what RL asks for) collected in vLLM's
    worker and fetched once per finished request, instead of vLLM's per-step, per-request log-prob objects (same
    values; on an H100 the server ran 1.23x faster with them, docs/benchmarks.md). Needs vLLM's V2 model runner without
    speculative decoding and one data-parallel replica; otherwise the server logs why and uses vLLM's path."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Maximum number of sequences per engine step; unset keeps vLLM's default."""
    max_cudagraph_capture_size: int | None = Field(default=None, ge=1)
    """Largest engine step (in tokens: one per decoding sequence) replayed from a CUDA graph; larger steps run
    eagerly. Unset: ``max_num_seqs`` (1024 when that is unset, ``vllm serve``'s default on an H100), never below
    vLLM's own min(2 x max_num_seqs, 512). vLLM alone stops at 512 while adaptive concurrency runs up to 1,024
    rollouts: the long-tail loop's continuous arm ran 1.23x faster with graphs up to 1,024 (two H200s,
    docs/benchmarks.md), for ~6 s more start-up and ~0.3 GiB."""
    enable_prefix_caching: bool | None = None
    """Prefix caching; unset keeps vLLM's default."""
    enable_fp32_lm_head: bool = True
    """Compute the LM head in fp32 (log-prob fidelity with the trainer); ignored when vLLM lacks the option."""
    extra_args: list[str] = Field(default_factory=list)
    """Further ``vllm serve`` flags, e.g. ``["--kv-cache-dtype", "fp8"]``; parsed by vLLM's own parser."""

    @model_validator(mode="after")
    def _check_engines(self) -> VllmConfig:
        if self.engines > 1 and (self.data_parallel_size > 1 or self.headless):
            raise ValueError(
                f"engines={self.engines} runs several engines on the same GPUs: it needs data_parallel_size = 1 "
                "and no headless nodes (vLLM's data parallelism puts each engine on GPUs of its own)"
            )
        return self


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's parser names the torch engine serves, and the `renderers` parser each one wraps.
TORCH_TOOL_PARSERS = {
    "hermes": "qwen3",
    "qwen3_xml": "qwen3.5",
    "qwen3_coder": "qwen3.5",
    "glm45": "glm",
    "glm47": "glm",
    "deepseek_v3": "deepseek-v3",
}
TORCH_REASONING_PARSERS = ("qwen3", "deepseek_r1")
TOOL_PARSER_SETTINGS = ("auto", "none")
"""``tool_call_parser`` values that are not parser names: detect one from the chat template, or none."""


class LoRAServingConfig(BaseConfig):
    """LoRA adapters served next to the base model; requests pick one with ``"model": "<adapter name>"``.

    The torch engine serves adapters whenever asked; vLLM needs LoRA enabled at start-up, which happens when
    ``model.lora`` is set, ``adapters`` is non-empty or ``enable`` is true."""

    enable: bool = False
    """Start vLLM with LoRA support even without ``model.lora`` (adapters then arrive via /v1/load_lora_adapter)."""
    adapters: dict[str, str] = Field(default_factory=dict)
    """Adapters loaded at start-up: name -> PEFT adapter directory."""
    max_loras: int = Field(default=8, ge=1)
    """vLLM: adapters that can take part in one batch (one per multi-tenant run, at least)."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """vLLM: adapters cached in CPU memory; unset equals ``max_loras``."""
    max_lora_rank: int | None = None
    """vLLM: largest adapter rank served, one of 8 16 32 64 128 256 320 512; unset rounds ``model.lora.rank`` up
    (64 without ``model.lora``)."""

    @model_validator(mode="after")
    def _check(self) -> LoRAServingConfig:
        if self.max_lora_rank is not None and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank={self.max_lora_rank} must be one of {', '.join(map(str, VLLM_LORA_RANKS))}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


class InferenceConfig(BaseConfig):
    """The ``inference`` process."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model to serve (HF directory or hub id); its tokenizer and chat template come from the same place."""
    engine: Literal["auto", "vllm", "torch"] = "auto"
    """Engine: auto picks vLLM when CUDA and the ``vllm`` extra are available, else the PyTorch engine."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP server settings."""
    max_model_len: int | None = Field(default=None, ge=2, le=MAX_SEQ_LEN)
    """Longest prompt + completion in tokens; unset uses the model's ``max_position_embeddings``."""
    max_batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Torch engine: sequences decoded together (the running batch); more requests wait in a queue."""
    logprobs_mode: Literal["processed", "raw"] = "raw"
    """Which logits returned log-probs come from (vLLM's raw_logprobs / processed_logprobs): raw, vLLM's default, is
    log_softmax of the model's logits; processed is the distribution the token was drawn from (after logit bias,
    penalties, temperature, min_p, top-k and top-p; greedy counts temperature as 1), which is what the trainer
    recomputes. ``rl`` sets processed for the server it starts (and writes it into that server's config), as
    prime-rl does."""
    enable_auto_tool_choice: bool | None = None
    """Parse tool calls out of chat completions whose request has ``tools`` (vLLM's flag). Unset: on whenever a
    tool-call parser is in use (``tool_call_parser`` names one or ``auto`` finds one); false: off."""
    tool_call_parser: str = "auto"
    """Tool-call format, by vLLM's parser names: ``hermes`` (Qwen2.5/Qwen3), ``qwen3_xml``/``qwen3_coder``,
    ``glm45``/``glm47``, ``deepseek_v3``; the vLLM engine takes any name vLLM knows, the torch engine these.
    ``auto``: the parser that matches how the served model's chat template writes tool calls, when the template
    renders tools (the startup line names it, or says why there is none); ``none``: no parser (a request with
    tools is then a 400 that names this setting and ``enable_auto_tool_choice``)."""
    reasoning_parser: str | None = None
    """Split reasoning from content (``message.reasoning``), by vLLM's names: ``qwen3``, ``deepseek_r1``. The vLLM
    engine takes any name vLLM knows; the torch engine these, with vLLM 0.26's semantics."""
    weight_update: Literal["in_flight", "drain"] = "drain"
    """How ``/update_weights`` meets running requests (docs/inference.md ## Weight updates): ``drain`` lets them
    finish on the old weights first (each completion from one weight step); ``in_flight`` swaps at the next engine
    step and they go on with the new weights (their KV cache kept). ``rl`` sets in_flight with
    ``max_off_policy_steps``."""
    seed: Seed = 0
    """Seed of requests that carry no seed of their own (and of vLLM's engine)."""
    output_dir: Path | None = None
    """Run directory; the log goes to ``<output_dir>/logs/inference.log``. Unset: a directory of this server's own,
    ``outputs/<model>-inference-<port>`` (``Qwen/Qwen3-0.6B`` on port 8000: ``outputs/Qwen-Qwen3-0.6B-inference-8000``;
    ``rl`` gives the server it starts the run's directory)."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging settings."""
    torch: TorchEngineConfig = Field(default_factory=TorchEngineConfig)
    """PyTorch engine settings."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (passed through)."""
    lora: LoRAServingConfig = Field(default_factory=LoRAServingConfig)
    """LoRA adapters (multi-adapter serving; ``model.lora`` turns it on for an RL run)."""

    @model_validator(mode="after")
    def _check_lora_rank(self) -> InferenceConfig:
        rank = self.model.lora.rank if self.model.lora is not None else None
        if rank is not None and rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank={rank} exceeds the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")
        if rank is not None and self.lora.max_lora_rank is not None and self.lora.max_lora_rank < rank:
            raise ValueError(f"lora.max_lora_rank={self.lora.max_lora_rank} is below model.lora.rank={rank}")
        if self.engine == "vllm" and self.lora_enabled and self.model.dtype == "float32":
            # vLLM's LoRA kernels assert half precision only once the engine has started.
            raise ValueError("model.dtype='float32' cannot serve LoRA adapters on vLLM: use bfloat16 or float16")
        return self

    @model_validator(mode="after")
    def _check_parsers(self) -> InferenceConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser == "none":
            raise ValueError("enable_auto_tool_choice requires a tool_call_parser (a parser name, or auto)")
        if self.engine == "torch":
            known = (*TOOL_PARSER_SETTINGS, *TORCH_TOOL_PARSERS)
            if self.tool_call_parser not in known:
                raise ValueError(
                    f"tool_call_parser={self.tool_call_parser!r}: the torch engine knows {', '.join(known)}"
                )
            if self.reasoning_parser is not None and self.reasoning_parser not in TORCH_REASONING_PARSERS:
                raise ValueError(
                    f"reasoning_parser={self.reasoning_parser!r}: the torch engine knows "
                    f"{', '.join(TORCH_REASONING_PARSERS)}"
                )
        return self

    @property
    def tool_parser(self) -> str | None:
        """The tool-call parser in effect (None for ``none``, and for ``auto`` until the server has resolved it)."""
        return None if self.tool_call_parser in TOOL_PARSER_SETTINGS else self.tool_call_parser

    @property
    def auto_tool_choice(self) -> bool:
        """Whether tool calls are parsed out of ``tool_choice: auto`` requests (vLLM's --enable-auto-tool-choice)."""
        return self.tool_parser is not None and self.enable_auto_tool_choice is not False

    @property
    def lora_enabled(self) -> bool:
        return self.lora.enable or self.model.lora is not None or bool(self.lora.adapters)

    @property
    def max_lora_rank(self) -> int:
        """The vLLM rank bound: the configured one, else model.lora.rank rounded up to a rank vLLM accepts."""
        if self.lora.max_lora_rank is not None:
            return self.lora.max_lora_rank
        if self.model.lora is None:
            return 64
        return next(r for r in VLLM_LORA_RANKS if r >= self.model.lora.rank)

    @model_validator(mode="after")
    def _default_output_dir(self) -> InferenceConfig:
        if self.output_dir is None:
            self.output_dir = default_run_dir(self.model.name, f"inference-{self.server.port}")
            self.__pydantic_fields_set__.discard("output_dir")  # still the default: rl gives it the run's directory
        return self

    @model_validator(mode="after")
    def _check_exposure(self) -> InferenceConfig:
        if not is_loopback(self.server.host) and not self.server.weight_roots:
            raise ValueError(
                f"server.host={self.server.host!r} is not loopback: set server.weight_roots so /update_weights "
                "cannot load arbitrary directories (and consider server.api_key)"
            )
        return self

    @property
    def served_model_name(self) -> str:
        return self.server.served_model_name or self.model.name
