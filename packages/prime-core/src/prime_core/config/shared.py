"""Config sections shared by several processes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prime_core.config.base import BaseConfig


class ModelConfig(BaseConfig):
    """Which model to load and how."""

    name: str = "Qwen/Qwen3-0.6B"
    """HF-format directory or hub id (hub ids need network access the first time)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype: auto is bfloat16 on GPU and float32 on CPU."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the model directory (transformers fallback only)."""


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
