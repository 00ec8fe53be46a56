"""Configs of the ``orchestrator`` and ``eval`` entry points."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from prime_core.config.advantage import AdvantageConfig, LengthPenaltyConfig  # noqa: F401 (their home before)
from prime_core.config.base import BaseConfig
from prime_core.config.distill import DistillConfig  # noqa: F401 (its home before)
from prime_core.config.env import EnvConfig, MaxTurns, check_unique_names  # noqa: F401 (MaxTurns' home before)
from prime_core.config.liveness import RecoveryConfig
from prime_core.config.shared import (
    MAX_BATCH,
    MAX_RETRIES,
    MAX_SEQ_LEN,
    MAX_TEMPERATURE,
    MAX_WORKERS,
    CheckpointConfig,
    HttpUrl,
    LogConfig,
    ModelConfig,
    MonitorConfig,
    Seed,
    default_run_dir,
)
from prime_core.transport import RolloutTransportConfig


class ClientConfig(BaseConfig):
    """How the orchestrator reaches the inference servers."""

    base_urls: list[HttpUrl] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Base URLs of the inference servers (no trailing /v1); requests are spread over them round-robin."""
    base_url: HttpUrl | None = None
    """One server (shorthand that replaces base_urls when set)."""
    api_key: str | None = None
    """API key sent as a bearer token to every route (None: no auth)."""
    api_key_var: str | None = None
    """Name of an environment variable holding the API key (used when ``api_key`` is unset)."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds before a single generation request fails."""
    max_retries: int = Field(default=3, ge=0, le=MAX_RETRIES)
    """Retries of a failed generation or admin request (connection errors, 5xx)."""
    renderer: str = "auto"
    """Chat renderer of token-in rollouts, a ``renderers`` name (``qwen3``, ``llama-3``, ``qwen3-vl``, ``default``
    for the tokenizer's own chat template, ...); ``auto`` detects it from the model's config and tokenizer."""
    renderer_args: dict[str, Any] = Field(default_factory=dict)
    """Renderer config fields (e.g. ``tool_parser = "qwen3"`` for ``default``, ``enable_thinking`` for qwen3)."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """Rollouts in flight at most (the ``adaptive`` ceiling; the ``fixed`` count). Unset: 1024 adaptive, 64 fixed. Keep
    it low where each rollout holds a scarce resource (a sandbox, a tool server)."""
    concurrency: Literal["adaptive", "fixed"] = "adaptive"
    """``adaptive``: rollouts in flight follow the servers' /health load (KV-cache usage, queue, preemptions;
    docs/orchestrator.md); ``fixed``: ``max_concurrent``."""
    initial_concurrent: int = Field(default=64, ge=1)
    """Adaptive: the limit at start; it stays there while a server reports no KV-cache usage."""
    target_kv_usage: float = Field(default=0.9, gt=0, le=1)
    """Adaptive: the fullest server's KV-cache usage up to which the limit grows."""
    load_poll_interval: float = Field(default=1.0, gt=0)
    """Seconds between polls of every /health for its load (each bounded by as much, at least 0.5 s)."""
    health_timeout: float = Field(default=300.0, gt=0)
    """Seconds to wait for every server's /health at start-up."""
    server_run_id: str | None = None
    """Given by ``rl`` on the command line when it starts the inference server itself and this orchestrator beside
    it: until /health answers with this run id (the server rl started, not another run's on the same port) no
    request is sent. Not written to the resolved config, which stays usable against any server."""
    update_weights_timeout: float = Field(default=720.0, gt=0)
    """Seconds one POST /update_weights may take before it is retried."""

    @model_validator(mode="after")
    def _one_url(self) -> ClientConfig:
        if self.base_url is not None:
            self.base_urls = [self.base_url]
        if not self.base_urls:
            raise ValueError("client.base_urls is empty")
        # The OpenAI-style ".../v1" spelling names the same server: routes are joined to the bare base URL.
        self.base_urls = [u.rstrip("/").removesuffix("/v1") for u in self.base_urls]
        if self.max_concurrent is None:
            self.max_concurrent = 1024 if self.concurrency == "adaptive" else 64
        return self

    def resolved_api_key(self) -> str | None:
        import os

        if self.api_key is not None:
            return self.api_key
        return os.environ.get(self.api_key_var) if self.api_key_var else None


class JudgeEndpointConfig(BaseConfig):
    """Where the judges of the run's environments send their requests: every ``vf.JudgeConfig`` an environment's
    verifiers config holds (``task.judges`` plugins, judge fields of a task config such as ``task.judge``)."""

    enabled: bool = True
    """Point every judge at this endpoint (off: each keeps the endpoint its environment configures; verifiers'
    default is a hosted service)."""
    base_url: HttpUrl | None = None
    """OpenAI-compatible base URL (``.../v1``). Unset: the policy's own inference server, the first of
    ``client.base_urls`` (the one ``rl`` starts), so judging needs nothing outside the run."""
    model: str | None = None
    """Model named in judge requests. Unset: the run's ``model.name`` (a LoRA run's base) when ``base_url`` is unset,
    else required."""
    api_key_var: str | None = None
    """Environment variable holding the endpoint's API key. Unset: the policy server's key (``client.api_key`` /
    ``client.api_key_var``) when ``base_url`` is unset, else none."""
    timeout: float = Field(default=300.0, gt=0)
    """Seconds one judge request may wait for its answer (verifiers' own default waits forever)."""
    check: bool = True
    """At start, ask every judge endpoint of the run's environments for its models (``GET /models``) and stop with
    a one-line error naming the environment when one does not answer or does not serve the judge's model."""
    check_timeout: float = Field(default=30.0, gt=0)
    """Seconds that start-up check waits for each endpoint."""
    allow_policy_judge: bool = False
    """RL only: let the judges of training environments grade with the policy being trained (``base_url`` unset in
    a full fine-tune, or set to the policy's own server). Off, such a run stops at start with a one-line error
    naming ``orchestrator.judge.base_url``: the policy would be optimised against its own verdicts. A LoRA run's
    default judge is the base model, which the server serves without the adapter, so it needs no opt-in."""

    @model_validator(mode="after")
    def _model_with_url(self) -> JudgeEndpointConfig:
        if self.enabled and self.base_url is not None and not self.model:
            raise ValueError("judge.model is required with judge.base_url (the model that endpoint serves)")
        return self


class SamplingConfig(BaseConfig):
    """Sampling parameters of training rollouts."""

    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    """Sampling temperature (also sent to the trainer to scale its logits); 0 is greedy, at most 10."""
    max_tokens: int = Field(default=128, ge=1)
    """Maximum new tokens per model turn (at most the orchestrator's ``seq_len``)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""


class EvalSamplingConfig(SamplingConfig):
    """Sampling of eval rollouts (greedy by default)."""

    temperature: float = Field(default=0.0, ge=0, le=MAX_TEMPERATURE)
    """Sampling temperature (0: greedy; at most 10)."""
    max_tokens: int = Field(default=128, ge=1, le=MAX_SEQ_LEN)
    """Maximum new tokens per model turn."""


class FilterConfig(BaseConfig):
    """What is kept out of the training batch."""

    zero_advantage_groups: bool = True
    """Drop groups whose advantages are all zero (they carry no gradient); counted in filtered/groups."""
    long_samples: Literal["truncate", "drop"] = "truncate"
    """Samples longer than seq_len: cut at seq_len, or drop them (counted in filtered/long_samples)."""


class DifficultyPoolConfig(BaseConfig):
    """One difficulty pool of ``curriculum.sampler = "difficulty_pool"``."""

    threshold: float
    """Inclusive upper bound of the running mean reward of the pool's examples (the pool with the highest threshold
    also takes everything above it)."""
    weight: float = Field(ge=0)
    """Relative sampling weight of each example in the pool (0: never drawn while it is in this pool)."""


def _default_pools() -> dict[str, DifficultyPoolConfig]:
    return {
        "hard": DifficultyPoolConfig(threshold=0.25, weight=0.2),
        "normal": DifficultyPoolConfig(threshold=0.75, weight=1.0),
        "easy": DifficultyPoolConfig(threshold=1.0, weight=0.2),
    }


class CurriculumConfig(BaseConfig):
    """Which examples a step draws, and refilling the batch with groups that carry a learning signal (see
    docs/algorithms.md ## Curricula). Active when ``sampler = "difficulty_pool"`` or ``dynamic_sampling`` is on;
    needs finite tasksets. Its state is saved with the orchestrator checkpoint."""

    sampler: Literal["sequential", "difficulty_pool"] = "sequential"
    """sequential: each environment's examples in order (the default sampling); difficulty_pool: examples drawn with
    replacement, weighted by the pool their running mean reward falls in."""
    pools: dict[str, DifficultyPoolConfig] = Field(default_factory=_default_pools)
    """Pools of ``difficulty_pool`` by name (the defaults are prime-rl's: hard <= 0.25 weight 0.2, normal <= 0.75
    weight 1, easy <= 1 weight 0.2)."""
    unseen_weight: float = Field(default=1.0, ge=0)
    """Sampling weight of an example never scored yet."""
    reward_ema: float = Field(default=0.5, gt=0, le=1)
    """Weight of a new group's mean reward in its example's running mean reward (1: the latest group only)."""
    reject_advantage: tuple[float, float] | None = (0.0, 0.0)
    """Advantage-range gate: a group whose every advantage lies in [low, high] is rejected (not trained; replaced
    under dynamic sampling). The default rejects groups without signal; unset admits every group."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: after a step's groups finish, draw more groups until the step has ``batch_size /
    rollouts_per_example`` admitted groups or the draw cap is reached; surplus admitted groups are not trained."""
    max_draws_factor: float = Field(default=3.0, ge=1, le=100)
    """Cap of dynamic sampling: at most this many times the step's groups are drawn in all (at most 100)."""

    @model_validator(mode="after")
    def _check_curriculum(self) -> CurriculumConfig:
        if self.sampler == "difficulty_pool" and not any(p.weight > 0 for p in self.pools.values()):
            raise ValueError("curriculum.pools: at least one pool needs a positive weight")
        if self.reject_advantage is not None and self.reject_advantage[0] > self.reject_advantage[1]:
            raise ValueError("curriculum.reject_advantage: low must not exceed high")
        return self

    @property
    def enabled(self) -> bool:
        return self.sampler != "sequential" or self.dynamic_sampling


class EvalEnvsConfig(BaseConfig):
    """Evaluation during training."""

    envs: Annotated[list[EnvConfig], AfterValidator(check_unique_names)] = Field(default_factory=list)
    """Eval environments (separate from the training mix)."""
    interval: int = Field(default=100, ge=1)
    """Evaluate every N steps (on the weights loaded at that moment)."""
    num_examples: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Examples per eval environment."""
    rollouts_per_example: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Rollouts per example (pass@k for k up to this)."""
    eval_base: bool = True
    """Evaluate the base weights at step 0, before the first rollout (so no weight update lands mid-eval)."""
    temperatures: list[float] | None = None
    """Sampling temperatures to evaluate at (0 is greedy, one rollout per example), each logged as
    ``eval/<env>/t<temperature>/<metric>``; unset: the training sampling, logged as ``eval/<env>/<metric>``."""
    final: bool = True
    """Also evaluate the final policy (the weights the last step publishes) before the orchestrator exits, so a
    run ends with a before/after comparison; ``rl`` waits for it and prints both."""

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(not 0 <= t <= MAX_TEMPERATURE for t in v)):
            raise ValueError(f"eval temperatures must be a non-empty list of values in [0, {MAX_TEMPERATURE:g}]")
        return v


class LogExtrasConfig(BaseConfig):
    """Sample tables (prompt, completion, reward) written next to the metrics."""

    enabled: bool = True
    """Write samples tables."""
    interval: int = Field(default=10, ge=1)
    """Every N steps."""
    num_samples: int = Field(default=8, ge=1)
    """Rows per table."""


class BenchConfig(BaseConfig):
    """``orchestrator --bench``: inference throughput in isolation (no trainer, no weights)."""

    num_requests: int = Field(default=64, ge=1, le=MAX_BATCH)
    """Generation requests sent."""
    max_tokens: int = Field(default=64, ge=1, le=MAX_SEQ_LEN)
    """New tokens per request."""


class OrchestratorConfig(BaseConfig):
    """The orchestrator: rollouts from environments, advantages, packing, transport and weight relay."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model; its directory provides the tokenizer and the served model name."""
    output_dir: Path = Path("outputs")
    """Run directory shared with trainer and inference."""
    seq_len: int = Field(default=2048, ge=8, le=MAX_SEQ_LEN)
    """Tokens per packed trainer row."""
    max_steps: int = Field(default=20, ge=1)
    """Number of training steps to produce rollouts for."""
    async_level: int = Field(default=1, ge=0)
    """Rollouts of step n use weights of step >= n - async_level (0 = synchronous on-policy)."""
    max_off_policy_steps: int | None = Field(default=None, ge=0)
    """Continuous rollouts (docs/orchestrator.md): a rollout trains at step n only if n minus the weight step of its
    first token is at most this, queue time included (staler groups are cancelled or dropped, and redrawn); weights
    are updated in flight. Unset: the step-synchronous loop of ``async_level``."""
    dispatch_ahead: bool = False
    """Dispatch step n's rollouts one weight update early, each request held by the inference server until it serves
    weights n - async_level (``server.weight_wait_timeout``): the env side of the rollouts (prompts, tokenizing,
    requests on the way) is done when those weights land, and generation starts at once. Every token is still
    sampled with weights >= n - async_level; ``client.max_concurrent`` must leave room for the held rollouts beside
    the running ones, and the time a rollout is held counts toward its env's ``rollout_timeout``. Needs prime's
    inference server (a server without a version record, which cannot show it held a request, ends the run). Not
    with LoRA (adapters carry their own steps) or ``max_off_policy_steps``."""
    batch_size: int = Field(default=128, ge=1, le=MAX_BATCH)
    """Samples per step (groups of rollouts_per_example)."""
    rollouts_per_example: int = Field(default=8, ge=1, le=MAX_BATCH)
    """Group size: rollouts of one prompt whose rewards share a baseline."""
    micro_batch_rows: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Packed rows per micro-batch (one trainer forward/backward). On a GPU each forward has a fixed host-side cost
    (FSDP hooks, kernel launches: ~0.2 s for the Qwen3-0.6B shape on an H100 host), so short rows want several per
    micro-batch, about 16k tokens in all (the GPU configs: 8 x 2048); activations grow with it (docs/scaling.md)."""
    num_trainer_ranks: int = Field(default=1, ge=1)
    """Trainer data-parallel ranks (filled by the launcher); one file per rank per step."""
    seed: Seed = 0
    """Seed of environment mixing, prompt order and per-request sampling seeds."""
    client: ClientConfig = Field(default_factory=ClientConfig)
    """Inference servers."""
    env: list[EnvConfig] = Field(default_factory=lambda: [EnvConfig(id="reverse-text")])
    """Training environments, mixed by ratio."""
    eval: EvalEnvsConfig = Field(default_factory=EvalEnvsConfig)
    """Evaluation during training."""
    judge: JudgeEndpointConfig = Field(default_factory=JudgeEndpointConfig)
    """Where the environments' judges send their requests (default: the policy's own server)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling of training rollouts."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    filters: FilterConfig = Field(default_factory=FilterConfig)
    """Filters."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """Difficulty curriculum and dynamic sampling (off by default)."""
    transport: RolloutTransportConfig = Field(default_factory=RolloutTransportConfig)
    """Rollout transport to the trainer."""
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint interval (shared with the trainer) and resume step."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Metrics sinks."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    log_extras: LogExtrasConfig = Field(default_factory=LogExtrasConfig)
    """Samples tables."""
    weights_timeout: float = Field(default=1200.0, gt=0)
    """Seconds to wait for the weights a step needs before failing."""
    weights_broadcast: bool = False
    """The trainer sends each step once (``trainer.weights.broadcast.type`` nccl or cuda_ipc; ``rl`` sets this): each
    transfer blocks the trainer until inference takes it, so the orchestrator relays every step up to
    ``max_steps - 1`` before exiting, even those no rollout will use."""
    max_rollout_retries: int = Field(default=3, ge=0, le=MAX_RETRIES)
    """Times a rollout is re-run after its env server crashed under it (a crash loses no rollout)."""
    failed_rollouts: Literal["zero_reward", "drop"] = "zero_reward"
    """A rollout that raised or timed out: kept in its group with reward 0 (no tokens trained), or dropped."""
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    """Failing environments: hung env-server workers and tool servers replaced, rollouts screened, the share of a
    step's rollouts that must succeed (docs/liveness.md)."""
    bench: bool = False
    """Measure inference throughput in isolation and exit."""
    bench_config: BenchConfig = Field(default_factory=BenchConfig)
    """Benchmark settings."""

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example})"
            )
        names = [e.resolved_name for e in self.env]
        if len(set(names)) != len(names):
            raise ValueError(f"environment names must be unique, got {names}")
        if not self.env:
            raise ValueError("at least one training environment is needed (env)")
        if self.transport.type == "zmq" and self.num_trainer_ranks % len(self.transport.hosts):
            raise ValueError(f"transport.host names {len(self.transport.hosts)} trainer node(s) for num_trainer_ranks "
                             f"{self.num_trainer_ranks}: the ranks must split evenly over the nodes")  # fmt: skip
        if self.sampling.max_tokens > self.seq_len:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) > seq_len ({self.seq_len}): a completion "
                             "that long cannot fit a training sample")  # fmt: skip
        k = self.max_off_policy_steps
        if k is not None and k < self.async_level:
            raise ValueError(f"max_off_policy_steps ({k}) < async_level ({self.async_level}): batches formed that far "
                             "ahead would hold only stale rollouts")  # fmt: skip
        if self.dispatch_ahead and (k is not None or self.model.lora is not None):
            raise ValueError("dispatch_ahead holds requests until a step's weights: not with max_off_policy_steps "
                             "(weights change in flight) or LoRA (adapters carry their own steps)")  # fmt: skip
        if k is not None and self.curriculum.enabled:
            raise ValueError(
                "curriculum (difficulty_pool, dynamic_sampling) draws per step: unset max_off_policy_steps"
            )
        return self


class EvalConfig(BaseConfig):
    """``eval``: score a model (and optionally its checkpoints) on environments through an OpenAI-style server."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model name sent to the server."""
    output_dir: Path | None = None
    """Results go to ``<output_dir>/eval/``. Unset: ``outputs/<what>-eval``, named after the run of ``weights_dir``
    (``outputs/run-eval``), else the model (``outputs/Qwen-Qwen3-0.6B-eval``, ``outputs/run-step_60-eval``)."""
    environment_ids: list[str] = Field(default_factory=lambda: ["reverse-text"])
    """Environments to evaluate (comma separated on the CLI); ignored when ``env`` is set."""
    env_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per environment id: taskset config fields."""
    env: Annotated[list[EnvConfig], AfterValidator(check_unique_names)] = Field(default_factory=list)
    """Environments with every setting of ``[[orchestrator.env]]`` (harness, runtime, ...); overrides environment_ids."""
    client: ClientConfig = Field(default_factory=ClientConfig)
    """Inference server (the first base URL is used for weight loading)."""
    judge: JudgeEndpointConfig = Field(default_factory=JudgeEndpointConfig)
    """Where the environments' judges send their requests (default: the evaluated model's server)."""
    num_examples: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Examples per environment."""
    rollouts_per_example: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Rollouts per example; pass@k is reported for k = 1, 2, 4, ... up to this."""
    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    """Sampling of eval rollouts."""
    max_turns: MaxTurns = "auto"
    """Upper bound on model turns of every agent seat (None: no limit). ``auto``: the limit the environment declares
    for the seat, else none, as ``vf-eval`` would run it (each episode still ends at the environment's
    ``rollout_timeout`` and where the model's context is full)."""
    num_workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """Env workers per environment."""
    use_chat: bool = False
    """Talk to /v1/chat/completions through verifiers' eval client (any OpenAI server, no token ids); off: token-in
    generation with the model's renderer through verifiers' train client (tool calls parsed client-side)."""
    weights_dir: Path | None = None
    """Directory with step_N weight folders to evaluate (loaded through /update_weights; a relative path is resolved
    here, where eval runs)."""
    steps: list[int] = Field(default_factory=list)
    """Checkpoint steps under weights_dir to evaluate."""
    weights_timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait, before anything is scored, for a requested step's STABLE marker (a checkpoint still being
    written); past it the eval stops in one line, nothing scored."""
    eval_base: bool = True
    """Also evaluate the weights the server started with (first; restored with /reload_weights before scoring)."""
    seed: Seed = 0
    """Seed of example selection and sampling."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""

    @model_validator(mode="after")
    def _check_eval(self) -> EvalConfig:
        if not self.env and not self.environment_ids:
            raise ValueError("no environment to evaluate: set environment_ids or env")
        if self.steps and self.weights_dir is None:
            raise ValueError("steps needs weights_dir (the directory holding the step_N checkpoints)")
        if self.weights_dir is not None:
            self.weights_dir = self.weights_dir.expanduser().resolve()
            missing = [s for s in self.steps if not (self.weights_dir / f"step_{s}").is_dir()]
            if missing:
                found = sorted(p.name for p in self.weights_dir.glob("step_*")) if self.weights_dir.is_dir() else []
                raise ValueError(
                    f"steps: no step_{missing[0]} under {self.weights_dir} (found: {', '.join(found) or 'nothing'})"
                )
        self.output_dir = self.output_dir or default_run_dir(str(self.weights_dir or self.model.name), "eval")
        return self

    def resolved_envs(self) -> list[EnvConfig]:
        """The environments to evaluate: ``env``, else one per id of ``environment_ids``."""
        if self.env:
            return self.env
        return [
            EnvConfig(id=i, args=self.env_args.get(i, {}), max_turns=self.max_turns, num_workers=self.num_workers)
            for i in self.environment_ids
        ]
