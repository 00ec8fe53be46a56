"""Configs of the RL trainer (``trainer``) and the SFT trainer (``sft``).

Both share the sections below: model init, optimizer, scheduler, parallelism, checkpoints, performance
accounting and bench mode. The RL objective is a discriminated union on ``loss.type``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_core.config.base import BaseConfig
from prime_core.config.losses import GRPOLossConfig, LossConfig
from prime_core.config.parallel import ParallelConfig
from prime_core.config.shared import (
    MAX_BATCH,
    MAX_LR,
    MAX_SEQ_LEN,
    CheckpointConfig,
    LogConfig,
    ModelConfig,
    MonitorConfig,
    Seed,
)
from prime_core.transport import RolloutTransportConfig

# ---------------------------------------------------------------- model, parallelism, performance


class ModelInitConfig(BaseConfig):
    """How the trainer builds its model from ``model.name``."""

    random: bool = False
    """Random init from the model's config.json instead of loading its weights (e.g. to train from scratch)."""
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    """HF config fields to override before building (e.g. ``{"num_hidden_layers": 2}``); implies nothing else."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id when it is not next to the weights (default: ``model.name``)."""
    attn: Literal["auto", "sdpa", "flash_attn", "flash_attn4"] = "auto"
    """Attention kernel: ``flash_attn`` is FlashAttention-2 (the flash-attn extra), ``flash_attn4`` FlashAttention-4
    (``pip install flash-attn-4``; Hopper, Blackwell); ``auto`` picks FlashAttention-4 on a Hopper or newer GPU for rows
    of 32k tokens or more where it is installed (faster there, slower for short rows), else FlashAttention-2 on a GPU
    when installed, else SDPA."""
    logprob_chunk_size: int = Field(default=2048, ge=1)
    """Tokens per chunk of the fused log-prob head (bounds the memory of the [tokens, vocab] logits)."""
    freeze_vision: bool = False
    """Vision-language models: keep the vision tower (patch embedding, ViT blocks, mergers) fixed; only the language
    model trains. An error for text-only models."""


class PerfConfig(BaseConfig):
    """Throughput and MFU accounting."""

    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak bf16 TFLOP/s of one device for MFU; unset uses the GPU table (MFU is null on CPU)."""


class AdamWConfig(BaseConfig):
    """AdamW with decoupled weight decay and gradient-norm clipping."""

    type: Literal["adamw"] = "adamw"
    """Optimizer type."""
    lr: float = Field(default=1e-6, gt=0, le=MAX_LR)
    """Peak learning rate (at most 1: AdamW moves every weight by about lr per step)."""
    weight_decay: float = Field(default=0.01, ge=0, le=1)
    """Decoupled weight decay (not applied to norms and biases); at most 1 (each step scales the weights by
    1 - lr * weight_decay)."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = Field(default=1e-8, ge=0, le=1)
    """Adam epsilon, at most 1."""
    max_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; unset disables clipping (the norm is still logged)."""
    max_skipped_steps: int = Field(default=3, ge=0, le=1000)
    """Optimizer steps in a row that may be skipped for a NaN or infinite gradient norm (the weights and AdamW's
    moments stay as they were; the step is logged with ``optim/skipped``) before the trainer stops with an error.
    0 stops at the first; at most 1000."""


class ConstantSchedulerConfig(BaseConfig):
    """Linear warmup, then a constant learning rate."""

    type: Literal["constant"] = "constant"
    """Scheduler type."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to ``optim.lr`` (the first step trains at lr/warmup_steps)."""


class CosineSchedulerConfig(BaseConfig):
    """Linear warmup, then cosine decay to ``min_lr`` at ``max_steps``."""

    type: Literal["cosine"] = "cosine"
    """Scheduler type."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to ``optim.lr``."""
    min_lr: float = Field(default=0.0, ge=0, le=MAX_LR)
    """Learning rate reached at the last step (at most ``optim.lr``)."""


SchedulerConfig = Annotated[ConstantSchedulerConfig | CosineSchedulerConfig, Field(discriminator="type")]


# ---------------------------------------------------------------- data


class FakeDataConfig(BaseConfig):
    """Synthetic data for benchmarks and smoke tests (no orchestrator, no dataset)."""

    batch_size: int = Field(default=8, ge=1, le=MAX_BATCH)
    """Rows per optimizer step over all ranks."""
    micro_batch_size: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Rows per forward/backward pass."""
    seq_len: int | None = Field(default=None, ge=2, le=MAX_SEQ_LEN)
    """Row length; unset uses the top-level ``seq_len``."""
    variable_lengths: bool = False
    """Pack random-length samples into each row (position ids restart) instead of one full-length sample."""
    max_sample_len: int | None = Field(default=None, ge=2, le=MAX_SEQ_LEN)
    """With ``variable_lengths``: sample lengths are drawn from 2 .. this (e.g. 400 for the one-GPU RL loop's rows of
    about ten rollouts); unset draws up to the row length."""

    @model_validator(mode="after")
    def _divisible(self) -> FakeDataConfig:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        return self


class RLDataConfig(BaseConfig):
    """Where the RL trainer's micro-batches come from."""

    fake: FakeDataConfig | None = None
    """Train on synthetic micro-batches instead of the orchestrator's rollouts (set by ``--bench``)."""
    wait_timeout_s: float | None = Field(default=3600.0, gt=0)
    """Fail with a clear error when a step's rollouts have not arrived after this many seconds; unset waits forever."""
    keep_rollouts: int | None = Field(default=2, ge=1)
    """Filesystem transport: each rank deletes its ``rollouts/step_n`` files once it has read ``keep_rollouts`` newer
    steps (a resume never reads a consumed step: the orchestrator writes the resumed steps again); unset keeps all."""


class WeightBroadcastConfig(BaseConfig):
    """How new weights reach inference: HF files on a shared filesystem, a collective broadcast (NCCL), or CUDA IPC
    handles when trainer and inference share a GPU (the weight transports of docs/architecture.md)."""

    type: Literal["filesystem", "nccl", "cuda_ipc"] = "filesystem"
    """filesystem: write safetensors to ``weights/step_N`` every step; nccl: rank 0 broadcasts the tensors to every
    inference worker (gloo when the trainer runs on CPU); cuda_ipc: rank 0 hands inference workers on its own GPU
    its tensors by CUDA IPC handles, no copy through the host or disk (a LoRA run's adapter too). With nccl and
    cuda_ipc, files are written only for checkpoint steps, the final step and the initial weights. ``rl`` picks
    cuda_ipc when trainer and inference share one GPU, unless this is set to filesystem."""
    host: str = "127.0.0.1"
    """Address of the rendezvous store on the trainer's rank-0 host, reachable from every inference worker."""
    port: int = Field(default=29501, ge=1, le=65535)
    """Port of the rendezvous store."""
    inference_workers: int = Field(default=1, ge=1)
    """Inference workers that join the broadcast: summed over servers, each tensor-parallel x data-parallel GPUs
    (one per torch-engine server), times ``vllm.engines``. ``rl`` fills it from the inference config."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds to wait for the workers to join or for one transfer before failing with an error naming them."""
    bucket_mb: int = Field(default=1024, ge=1, le=65536)
    """Tensors are sent in flat buckets of about this many MiB (fewer, larger collectives; cuda_ipc holds at most
    two buckets on the GPU at a time); at most 65536 (64 GiB)."""

    @property
    def one_time(self) -> bool:
        """Each step is sent once to workers that join the transfer (nccl, cuda_ipc): ``rl`` counts those workers,
        and the orchestrator relays every step, since the trainer waits until inference takes it."""
        return self.type != "filesystem"


class WeightsConfig(BaseConfig):
    """Publishing of HF weights under ``weights/step_N`` for inference."""

    publish: bool = True
    """Write ``weights/step_{n+1}`` after every step (off in bench mode)."""
    keep_all: bool = False
    """Keep every published step instead of only the ones the async window and checkpoints need."""
    broadcast: WeightBroadcastConfig = Field(default_factory=WeightBroadcastConfig)
    """Transport of each step's weights to inference."""


class LossMaskConfig(BaseConfig):
    """Which message roles the SFT loss trains on."""

    system: bool = False
    """Train on system messages."""
    user: bool = False
    """Train on user messages."""
    assistant: bool = True
    """Train on assistant messages (the role header the template adds is never trained)."""
    tool: bool = False
    """Train on tool results."""


class SFTDataConfig(BaseConfig):
    """SFT dataset: rows in prompt-completion or ``messages`` format (``messages`` wins when both exist)."""

    path: str | None = None
    """A .jsonl/.json/.parquet file, a directory of them, or a ``datasets`` save_to_disk directory."""
    split: str = "train"
    """Split to read from a ``datasets`` DatasetDict directory."""
    fake: FakeDataConfig | None = None
    """Train on random tokens instead of a dataset (set by ``--bench``)."""
    batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Packed rows per optimizer step over all ranks."""
    micro_batch_size: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Packed rows per forward/backward pass."""
    shuffle: bool = True
    """Shuffle samples every epoch (with ``seed + epoch``)."""
    chat_template: str | None = None
    """A Jinja chat template (or a path to one) replacing the tokenizer's."""
    loss_mask: LossMaskConfig = Field(default_factory=LossMaskConfig)
    """Roles trained on."""

    @model_validator(mode="after")
    def _divisible(self) -> SFTDataConfig:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        return self


class SFTValConfig(BaseConfig):
    """Validation loss on a held-out split."""

    path: str | None = None
    """A separate validation dataset (same formats as ``data.path``); unset holds out ``fraction`` of the data."""
    fraction: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of ``data.path``'s samples held out for validation when ``path`` is unset (0 disables)."""
    interval: int = Field(default=50, ge=1)
    """Evaluate every this many steps (and before the first and after the last step)."""
    max_rows: int | None = Field(default=None, ge=1)
    """Evaluate on at most this many packed rows."""


# ---------------------------------------------------------------- process configs


class _TrainerBase(BaseConfig):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model to train (HF directory or hub id)."""
    init: ModelInitConfig = Field(default_factory=ModelInitConfig)
    """How the model is built (random init, config overrides, tokenizer, attention kernel)."""
    output_dir: Path = Path("outputs")
    """Run directory shared with the other processes."""
    seq_len: int = Field(default=2048, ge=2, le=MAX_SEQ_LEN)
    """Maximum row length in tokens."""
    max_steps: int = Field(default=20, ge=1)
    """Number of optimizer steps (absolute: a resumed run stops at the same step)."""
    seed: Seed = 0
    """Seed of model init and data order."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type; auto uses CUDA when available (NCCL), else CPU (gloo)."""
    gpu_memory_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    """Cap of each rank's CUDA memory as a share of its GPU (``torch.cuda.set_per_process_memory_fraction``): past it
    the trainer fails with an out-of-memory error instead of taking memory another process on the GPU counts on.
    ``rl`` sets it to ``devices.trainer_memory_fraction`` when the trainer shares its GPU with vLLM; unset: no cap."""
    optim: AdamWConfig = Field(default_factory=AdamWConfig)
    """Optimizer."""
    scheduler: SchedulerConfig = Field(default_factory=ConstantSchedulerConfig)
    """Learning-rate schedule."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Data parallelism and memory savers."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """DCP checkpoints under ``checkpoints/step_N/trainer`` and resume."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """HF weight export under ``weights/step_N``."""
    perf: PerfConfig = Field(default_factory=PerfConfig)
    """Throughput and MFU accounting."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Per-step metrics."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    bench: bool = False
    """Benchmark: a few steps on fake data (default shape unless ``data.fake`` is set), no checkpoints or weights;
    prints and writes a JSON summary."""
    bench_file: Path | None = None
    """Where ``--bench`` writes its JSON summary (default ``<output-dir>/bench/<process>.json``)."""

    @model_validator(mode="after")
    def _bench_defaults(self) -> _TrainerBase:
        if self.bench:
            if "max_steps" not in self.model_fields_set:
                self.max_steps = 5
            if self.data.fake is None:
                self.data.fake = FakeDataConfig()
        return self

    @model_validator(mode="after")
    def _schedule_fits_the_run(self) -> _TrainerBase:
        # Both used to be taken: a warmup past the last step never reaches optim.lr, and a cosine "decay" to a
        # min_lr above optim.lr raises the rate step after step.
        if self.scheduler.warmup_steps > self.max_steps:
            raise ValueError(f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) > max_steps ({self.max_steps}): "
                             "the learning rate would never reach optim.lr")  # fmt: skip
        if isinstance(self.scheduler, CosineSchedulerConfig) and self.scheduler.min_lr > self.optim.lr:
            raise ValueError(f"scheduler.min_lr ({self.scheduler.min_lr:g}) > optim.lr ({self.optim.lr:g}): "
                             "the cosine schedule decays from optim.lr down to min_lr")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _resume_before_the_end(self) -> _TrainerBase:
        if (step := self.ckpt.resume_step) is not None and step >= self.max_steps:
            raise ValueError(f"ckpt.resume_step ({step}) >= max_steps ({self.max_steps}): nothing is left to train "
                             "(max_steps counts from the run's start)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _cuda_graphs_serve_what_they_capture(self) -> _TrainerBase:
        if not self.parallel.cuda_graphs:
            return self
        m = self.model
        clash = next((what for bad, what in (
            (self.device == "cpu", "device = 'cpu' (they need CUDA)"),
            (m.cp > 1, "model.cp > 1"),
            (m.ep > 1, "model.ep > 1"),
            (m.lora is not None, "model.lora (adapter selection is host logic a graph would freeze)"),
            (m.fp8.recipe != "none", "model.fp8"),
            (m.dtype in ("bfloat16", "float16"), f"model.dtype = {m.dtype!r} (they need fp32 masters: auto or float32)"),
            (self.init.attn in ("flash_attn", "flash_attn4"),
             f"init.attn = {self.init.attn!r} (its cu_seqlens vary per micro-batch; use sdpa)"),
        ) if bad), None)  # fmt: skip
        if clash is not None:
            raise ValueError(f"parallel.cuda_graphs does not serve {clash}")
        return self

    @model_validator(mode="after")
    def _lora_publishes_files_or_through_gpu_memory(self) -> _TrainerBase:
        if self.model.lora is not None and self.weights.broadcast.type == "nccl":
            raise ValueError(
                "model.lora publishes adapters as files or, on a GPU shared with inference, through its memory: "
                "set weights.broadcast.type = 'filesystem' or 'cuda_ipc' (got 'nccl')"
            )
        return self


class LoRARunConfig(BaseConfig):
    """One tenant of a multi-tenant trainer: its own LoRA adapter, optimizer state and run directory."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """Adapter name; the run's orchestrator and inference serve it under this name (its ``model.lora.name``)."""
    output_dir: Path
    """The run's directory (its orchestrator's ``output_dir``): rollouts are read from it, adapters published to
    its ``weights/step_N`` and its metrics appended to its ``metrics.jsonl``."""
    lr: float | None = Field(default=None, gt=0, le=MAX_LR)
    """Peak learning rate of this run's adapter; unset uses ``optim.lr``."""


class TrainerConfig(_TrainerBase):
    """The RL trainer: consumes the orchestrator's micro-batches and publishes new weights every step."""

    async_level: int = Field(default=1, ge=0)
    """Rollouts of step n may come from weights n - async_level; sets which published weight steps are kept."""
    loss: LossConfig = Field(default_factory=GRPOLossConfig)
    """RL objective (grpo, gspo, cispo) and its options."""
    data: RLDataConfig = Field(default_factory=RLDataConfig)
    """Rollout input (or fake data)."""
    transport: RolloutTransportConfig = Field(default_factory=RolloutTransportConfig)
    """How micro-batches arrive from the orchestrator."""
    runs: list[LoRARunConfig] = Field(default_factory=list)
    """Multi-tenant LoRA: train one adapter per run on the shared frozen base, in lock-step (step n trains every
    run's ``rollouts/step_n``, each on its own adapter). Needs ``model.lora``; empty trains one run in
    ``output_dir``, which then holds only the trainer's checkpoints and logs."""

    @model_validator(mode="after")
    def _check_runs(self) -> TrainerConfig:
        if not self.runs:
            return self
        if self.model.lora is None:
            raise ValueError("runs (multi-tenant training) needs model.lora: every run trains its own LoRA adapter")
        names = [r.name for r in self.runs]
        dirs = [r.output_dir.resolve() for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"runs: adapter names must be unique, got {names}")
        if len(set(dirs)) != len(dirs) or self.output_dir.resolve() in dirs:
            raise ValueError("runs: every run needs its own output_dir, distinct from the trainer's output_dir")
        if self.transport.type != "filesystem":
            raise ValueError("runs (multi-tenant training) reads each run's rollouts from its directory: "
                             "use transport.type = 'filesystem'")  # fmt: skip
        if self.weights.broadcast.type != "filesystem":
            raise ValueError("runs (multi-tenant training) publish each run's adapter into its directory: "
                             f"use weights.broadcast.type = 'filesystem' (got {self.weights.broadcast.type!r})")  # fmt: skip
        return self


class SFTConfig(_TrainerBase):
    """The SFT trainer: chat-formatted datasets, role-based loss masking, packing, validation loss."""

    async_level: int = Field(default=0, ge=0)
    """Unused by SFT (kept so ``rl``-style shared configs validate)."""
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    """Training data."""
    val: SFTValConfig = Field(default_factory=SFTValConfig)
    """Validation loss."""
    weights_interval: int | None = Field(default=None, ge=1)
    """Also publish HF weights every N steps (the final step is always published)."""
    overwrite: bool = False
    """Start afresh in an output directory that holds another run: its configs, logs, metrics, weights and
    checkpoints are deleted first. Without it such a directory is an error (unless ``ckpt.resume_step`` resumes it)."""

    @model_validator(mode="after")
    def _needs_data(self) -> SFTConfig:
        if self.data.fake is None and self.data.path is None:
            raise ValueError("set data.path (a dataset) or data.fake (synthetic tokens)")
        if self.overwrite and self.ckpt.resume_step is not None:
            raise ValueError("overwrite and ckpt.resume_step exclude each other")
        return self
