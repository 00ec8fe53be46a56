"""Config sections shared by several processes."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal
from urllib.parse import urlparse

from pydantic import AfterValidator, Field, field_validator

from prime_core.config.base import BaseConfig

# Packed rows are allocated whole (orchestrator and trainer), so a seq_len of 10**12 fails on its first step with a
# 7 TiB allocation; 16M tokens is beyond any model's context and still refused at once.
MAX_SEQ_LEN = 1 << 24
# Upper bounds of values that cannot be right and that a run would otherwise find only late (an optimizer step of
# inf, a loss that overflows float32, a step that never fills): one line at parse instead.
MAX_LR = 1.0
"""Learning rates: AdamW moves every weight by about lr per step, so above 1 the first step destroys the model."""
MAX_COEF = 100.0
"""Loss coefficients and clip ranges: past this the term swamps the loss (1e39 is float32's inf, a NaN step)."""
MAX_BATCH = 1 << 20
"""Samples, rows or rollouts of one step: a million is past any run, 10**12 an allocation or a step that never
ends."""
MAX_TEMPERATURE = 10.0
"""Sampling temperatures: at 10 a model's distribution is close to uniform over its vocabulary (noise)."""
MAX_RETRIES = 100
"""Retries of one request: more is an unbounded wait in disguise."""
MAX_WORKERS = 1024
"""Processes or workers started for one part of a run."""
# numpy's and vLLM's seeding take 0 .. 2**32 - 1; a larger seed overflowed in torch's generator with a traceback.
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


MAX_RUN_LABEL = 128
"""Characters of a model's name kept in its default run directory: two path parts joined can exceed a file name's 255."""


def default_run_dir(name: str, kind: str) -> Path:
    """``outputs/<label>-<kind>``: the run directory of an ``inference`` or ``eval`` given no ``output_dir``, named as
    the examples name theirs (``outputs/reverse-text-rl``) after what it serves or scores, so that two of them (or one
    and an ``rl`` run in ``outputs``) do not mix their logs and results. ``name`` is a model (its last two parts:
    ``Qwen/Qwen3-0.6B`` is ``Qwen-Qwen3-0.6B``), a checkpoint of a run (``outputs/run/weights/step_60`` is
    ``run-step_60``) or a run's weights directory (``outputs/run/weights`` is ``run``)."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("/", ".", "..", "~")]
    if len(parts) >= 3 and parts[-2] == "weights" and re.fullmatch(r"step_\d+", parts[-1]):
        parts = [parts[-3], parts[-1]]
    elif len(parts) >= 2 and parts[-1] == "weights":
        parts = [parts[-2]]
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts[-2:])).strip("._-")[:MAX_RUN_LABEL] or "model"
    return Path("outputs") / f"{label}-{kind}"


def _http_url(url: str) -> str:
    """A server's base URL must parse: a port above 65535 used to surface as an OverflowError traceback from the
    first connect, a bare host name as a request error after the run started."""
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(c.isspace() for c in url.strip()):
        raise ValueError("not an http(s) URL like http://127.0.0.1:8000")
    try:
        parsed.port  # noqa: B018 - urllib checks the range only when asked
    except ValueError:
        raise ValueError("the port must be 0-65535") from None
    return url


HttpUrl = Annotated[str, AfterValidator(_http_url)]
"""A server's http(s) base URL, checked at load."""

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers LoRA can adapt: the attention projections and the dense (SwiGLU) MLP projections."""


class LoRAConfig(BaseConfig):
    """Low-rank adapters: the base weights stay frozen; only the adapters train, publish and get served."""

    rank: int = Field(default=16, ge=1, le=4096)
    """Rank r of every adapter (A is [r, in], B is [out, r]); at most 4096."""
    alpha: float = Field(default=32.0, gt=0, le=1e5)
    """Scaling numerator: the update is (alpha / rank) * B @ A; at most 1e5."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (the base path never sees it)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """Which linear layers get adapters, by name (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj).
    MoE expert weights are not adapted (their MLPs have no gate/up/down linear layers)."""
    name: str | None = None
    """Adapter name served by inference and sent as the request's ``model`` (default ``r<rank>-a<alpha>``)."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"must name at least one of {', '.join(LORA_TARGET_MODULES)}")
        unknown = [t for t in value if t not in LORA_TARGET_MODULES]
        if unknown:
            raise ValueError(
                f"unknown target module(s) {unknown}; expected names from {', '.join(LORA_TARGET_MODULES)}"
            )
        return list(dict.fromkeys(value))

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", value):
            raise ValueError(f"{value!r} must be 1-128 letters, digits, '_', '-' or '.', starting with a letter/digit")
        return value

    @property
    def adapter_name(self) -> str:
        return self.name or f"r{self.rank}-a{self.alpha:g}"


class Fp8Config(BaseConfig):
    """FP8 training of the decoder's matmuls (trainer only; inference ignores it). See docs/scaling.md, "FP8"."""

    recipe: Literal["none", "tensorwise", "rowwise"] = "none"
    """Dynamic scaling recipe (torchao's of the same name): ``tensorwise`` (one scale per tensor, e5m2 gradients;
    fastest) or ``rowwise`` (one power-of-two scale per row, all e4m3; more accurate); ``none`` trains in bf16.
    Needs a GPU of compute capability >= 8.9 (Ada, Hopper); CPU runs it emulated, for tests only."""
    backend: Literal["auto", "torch", "te"] = "auto"
    """``torch`` (``torch._scaled_mm`` / ``torch._scaled_grouped_mm``), ``te`` (NVIDIA Transformer Engine,
    ``pip install 'prime-models[fp8]'``), or ``auto``: ``te`` when it is installed, else ``torch``."""
    skip: list[str] = Field(default_factory=list)
    """Extra modules kept in bf16, as fnmatch patterns on qualified names (e.g. ``*.down_proj``,
    ``model.layers.0.*``). The LM head, embeddings, routers and layers with dims not multiple of 16 never convert."""
    moe: bool = True
    """Also run MoE expert grouped matmuls in FP8 (rowwise scales; sm90+, ``torch`` backend only)."""


class ModelConfig(BaseConfig):
    """Which model to load and how."""

    name: str = "Qwen/Qwen3-0.6B"
    """HF-format directory or hub id ``org/name`` (hub ids need network access the first time). A name starting
    with ``/``, ``.`` or ``~``, with more than one ``/``, or whose first part is a local directory is a path and
    must exist; a hub id not yet in the HF cache fails at once offline (``HF_HUB_OFFLINE=1``, no network)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype: auto is bfloat16 on GPU and float32 on CPU."""
    trust_remote_code: bool = False
    """Allow custom code from the model directory: inference's tokenizer, its torch engine's transformers fallback and
    vLLM (``--trust-remote-code``); the trainer does not read it."""
    lora: LoRAConfig | None = None
    """Train (trainer) or serve (inference, orchestrator) a LoRA adapter on the frozen base; unset: full weights."""
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    """FP8 linear layers for training (``--model.fp8.recipe tensorwise``); off by default."""
    ep: int = Field(default=1, ge=1)
    """Trainer expert parallelism: each rank holds num_experts / ep experts of every MoE layer and tokens travel to
    them by all-to-all. Borrows ranks from the data-parallel shard axis: ep must be a multiple of cp, divide
    dp_shard * cp and divide the number of experts. 1 keeps every expert on every rank (FSDP-sharded)."""
    ep_dispatcher: Literal["torch", "deepep"] = "torch"
    """Expert-parallel token dispatch: torch.distributed all-to-all (any device) or DeepEP's kernels (GPU; DeepEP is
    built from source, see docs/scaling.md)."""
    cp: int = Field(default=1, ge=1)
    """Trainer context parallelism: every packed row is split over cp adjacent ranks (ring attention, zig-zag load
    balance). cp must divide the world size, and seq_len must be divisible by 2 * cp."""


class WandbConfig(BaseConfig):
    """Weights & Biases logging. Off unless ``enabled``; ``offline`` works without network."""

    enabled: bool = False
    """Log to W&B."""
    project: str = "prime"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); the default entity when unset."""
    name: str | None = None
    """Run name; the launcher suffixes it with -trainer / -orchestrator."""
    group: str | None = None
    """Run group, to keep a run's processes together."""
    offline: bool = False
    """Write runs locally (``wandb sync`` later) instead of streaming them."""
    tags: list[str] = Field(default_factory=list)
    """Tags attached to the run."""


class MonitorConfig(BaseConfig):
    """Where per-step metrics go."""

    jsonl: bool = True
    """Append one JSON object per step to ``<output-dir>/metrics.jsonl``."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """W&B settings."""


class LogConfig(BaseConfig):
    """Console and file logging."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level for the console and the log file."""
    file: bool = True
    """Also write ``<output-dir>/logs/<process>.log``."""


class CheckpointConfig(BaseConfig):
    """Checkpoints of trainer (DCP: model, optimizer, progress) and orchestrator (progress)."""

    interval: int | None = Field(default=None, ge=1)
    """Save every N steps; unset saves none (the final weights are always published)."""
    keep: int | None = Field(default=None, ge=1)
    """Keep only the newest N checkpoints; unset keeps all."""
    save_async: bool = False
    """Save in the background while training continues."""
    resume_step: int | None = Field(default=None, ge=0)
    """Resume from the checkpoint of this step; -1 is not allowed, use the step number."""
