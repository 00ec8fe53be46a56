"""Config of the ``rl`` launcher: the three process configs plus shared fields that fill them.

A shared top-level field (``model``, ``output_dir``, ``seq_len``, ``max_steps``, ``async_level``,
``max_off_policy_steps``, ``seed``, ``ckpt``, ``log``, ``transport``, ``wandb``) is copied into every sub-config that
has the field and does not set it itself; sections are filled key by key. A key set both at the top and in a sub-config with a
different value is an error listing every conflict, except ``output_dir``: the shared one replaces the
sub-configs' (a dry run's resolved process configs carry its directory, and ``rl --trainer @
outputs/configs/trainer.toml ... --output-dir outputs2`` starts the same run elsewhere).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PositiveInt, PrivateAttr, model_validator

from prime_core.config.base import BaseConfig
from prime_core.config.distill import TeacherServerConfig
from prime_core.config.inference import InferenceConfig
from prime_core.config.liveness import LivenessConfig
from prime_core.config.orchestrator import EnvConfig, OrchestratorConfig
from prime_core.config.shared import (
    MAX_LR,
    MAX_SEQ_LEN,
    MAX_WORKERS,
    CheckpointConfig,
    LogConfig,
    ModelConfig,
    Seed,
    WandbConfig,
)
from prime_core.config.trainer import TrainerConfig
from prime_core.transport import RolloutTransportConfig

PROCESSES = ("trainer", "orchestrator", "inference")
SHARED_FIELDS = ("model", "output_dir", "seq_len", "max_steps", "async_level", "max_off_policy_steps", "seed", "ckpt",
                 "log", "transport")  # fmt: skip
_PROCESS_CLASSES: dict[str, type[BaseModel]] = {
    "trainer": TrainerConfig,
    "orchestrator": OrchestratorConfig,
    "inference": InferenceConfig,
}
# Launcher-owned variables: set per process by rl, never by the user.
PROTECTED_ENV_VARS = frozenset({"CUDA_VISIBLE_DEVICES", "PRIME_RUN_ID"})


class DevicesConfig(BaseConfig):
    """Which devices each process gets. Inference takes the first GPUs, the trainer the next ones; colocated, both
    start at the first GPU and share it."""

    type: Literal["auto", "cuda", "cpu"] = "auto"
    """auto uses GPUs when any are visible (``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``), else runs everything
    on CPU (torch inference engine, trainer over gloo); a config with ``trainer.device = "cpu"`` and the torch
    engine (or no inference server) runs on CPU either way."""
    gpu_ids: list[int] | None = None
    """GPU ids to split between inference and trainer; default: ``CUDA_VISIBLE_DEVICES``, else every GPU."""
    num_inference_gpus: int = Field(default=1, ge=1)
    """GPUs of the inference server (vLLM data parallelism over them: DP = GPUs / tensor parallel)."""
    num_trainer_gpus: int = Field(default=1, ge=1)
    """GPUs of the trainer; more than one runs it under ``torchrun --nproc-per-node``."""
    num_cpu_trainer_procs: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """CPU only: trainer ranks (more than one runs ``torchrun`` over gloo)."""
    cpu_threads: dict[Literal["inference", "trainer", "orchestrator", "teacher"], PositiveInt] = Field(
        default_factory=dict
    )
    """Torch threads (``OMP_NUM_THREADS``) of a process on CPU, by role (trainer: per rank), e.g.
    ``{trainer = 1}``. Unset roles: the orchestrator gets 1, the inference servers (policy and teacher) and the
    trainer ranks share the cores evenly (or all inherit ``OMP_NUM_THREADS`` when it is set in ``env_vars`` or the environment)."""
    colocate: bool | None = None
    """Run inference and the trainer on the same GPUs (inference on the first ``num_inference_gpus``, the trainer
    on the first ``num_trainer_gpus``), splitting each GPU's memory by ``inference_memory_fraction``; weights then go
    through the GPU's memory on one GPU (``cuda_ipc``), by files over several. Unset: colocate when exactly one GPU is
    available and rl starts the inference server."""
    inference_memory_fraction: float = Field(default=0.45, gt=0.0, lt=1.0)
    """Colocated: the share of each GPU's memory vLLM takes (weights, activations, CUDA graphs, KV cache); it
    replaces ``inference.vllm.gpu_memory_utilization``, which is meant for a GPU of its own. The default leaves the
    trainer the larger share: it keeps ~18 bytes per parameter (fp32 master weights, gradients and Adam moments,
    plus the bf16 copy it computes with) and activations, where vLLM's share beyond 2 bytes per parameter is KV
    cache, which only bounds how many rollouts run at once."""
    trainer_memory_fraction: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Colocated: the share of each GPU's memory the trainer's estimated need must fit in (``rl`` refuses to start
    otherwise); unset: what vLLM leaves, ``1 - inference_memory_fraction``. Also the trainer's cap
    (``trainer.gpu_memory_fraction``): past it the trainer fails with an out-of-memory error rather than eat into
    vLLM's KV cache."""
    trainer_memory_margin_gib: float = Field(default=2.0, ge=0.0)
    """Colocated: GiB added to the trainer's estimated weights, gradients, optimizer states and a micro-batch's
    activations for the layers FSDP gathers at a time, the CUDA context and allocator slack (on one H100 the
    Qwen3-0.6B shape peaked 0.9 GiB above that estimate, without the CUDA context)."""
    gpu_memory_gib: float | None = Field(default=None, gt=0.0)
    """Colocated: memory of each GPU for the fit check; unset: read with ``nvidia-smi`` (no check without it)."""

    @model_validator(mode="after")
    def _check_memory_shares(self) -> DevicesConfig:
        trainer = self.trainer_memory_fraction
        if trainer is not None and trainer + self.inference_memory_fraction > 1.0:
            raise ValueError(
                f"devices.inference_memory_fraction ({self.inference_memory_fraction}) + "
                f"devices.trainer_memory_fraction ({trainer}) exceed 1"
            )
        return self


class RLRunConfig(BaseConfig):
    """One tenant of a multi-tenant LoRA deployment: its own adapter, orchestrator and run directory. Every run
    shares the trainer process, the frozen base and the inference server."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """Run and adapter name: the orchestrator ``orchestrator-<name>`` requests it from inference as its
    ``model.lora.name``."""
    output_dir: Path | None = None
    """The run's directory (its rollouts, adapter ``weights/step_N``, orchestrator checkpoints and
    ``metrics.jsonl``); default ``<output_dir>/runs/<name>``."""
    lr: float | None = Field(default=None, gt=0, le=MAX_LR)
    """Peak learning rate of the run's adapter; unset uses ``trainer.optim.lr``."""
    seed: Seed | None = None
    """Seed of the run's orchestrator (example order, sampling); unset uses ``orchestrator.seed``."""
    env: list[EnvConfig] | None = None
    """Environments of the run's orchestrator; unset uses ``orchestrator.env``."""


def _is_set(value: Any) -> bool:
    return value is not None


def _as_dict(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return False
    return str(a) == str(b)


def _fill(target: dict[str, Any], key: str, value: Any, path: str, conflicts: list[str]) -> None:
    """Copy ``value`` into ``target[key]`` where absent; recurse into sections; record differing leaves."""
    value = _as_dict(value)
    if key not in target or target[key] is None:
        target[key] = value
        return
    existing = _as_dict(target[key])
    if isinstance(value, dict) and isinstance(existing, dict):
        merged = dict(existing)
        for sub_key, sub_value in value.items():
            _fill(merged, sub_key, sub_value, f"{path}.{sub_key}", conflicts)
        target[key] = merged
    elif not _same(existing, value):
        conflicts.append(f"{path} is {existing!r} but the shared value is {value!r}")


def _continuous_async_level(data: dict[str, Any]) -> dict[str, Any]:
    """Continuous rollouts with no ``async_level`` anywhere: dispatch as far ahead as the bound allows less one step of
    slack (K - 1, at least 1 and at most K). A long-tailed rollout outlives several steps, and batches form on time only
    if its group started that far ahead (docs/orchestrator.md, "Choosing K and async_level")."""
    k = data.get("max_off_policy_steps")
    if isinstance(k, str) and k.strip().isdigit():  # the command line's text
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0 or _is_set(data.get("async_level")):
        return data
    for name in ("trainer", "orchestrator"):
        sub = _as_dict(data.get(name))
        if isinstance(sub, dict) and _is_set(sub.get("async_level")):
            return data
    return {**data, "async_level": max(k - 1, min(k, 1))}


def _share(data: dict[str, Any]) -> dict[str, Any]:
    """Fill the process sections with the shared top-level fields (see the module docstring)."""
    data = _continuous_async_level(dict(data))
    conflicts: list[str] = []
    wandb = _as_dict(data.get("wandb"))
    if isinstance(wandb, dict):
        data["wandb"] = wandb = {"enabled": True, **wandb}
    for name in PROCESSES:
        sub = _as_dict(data.get(name))
        if sub is None:
            if name == "inference":
                continue
            sub = {}
        if not isinstance(sub, dict):
            continue
        sub = dict(sub)
        if name == "inference" and not _is_set(data.get("output_dir")) and not _is_set(sub.get("output_dir")):
            # The server rl starts shares the run's directory, not the one a lone `inference` would take.
            sub["output_dir"] = _run_dir_of(data)
        fields = _PROCESS_CLASSES[name].model_fields
        for key in SHARED_FIELDS:
            value = data.get(key)
            if _is_set(value) and key in fields:
                if key == "output_dir":
                    sub[key] = value
                else:
                    _fill(sub, key, value, f"{name}.{key}", conflicts)
        if isinstance(wandb, dict) and "monitor" in fields:
            _fill(sub, "monitor", {"wandb": wandb}, f"{name}.monitor", conflicts)
        data[name] = sub
    if conflicts:
        raise ValueError("shared fields conflict with sub-configs: " + "; ".join(conflicts))
    return data


def _run_dir_of(data: dict[str, Any]) -> Any:
    """The run directory without a shared ``output_dir``: the trainer's (default ``outputs``)."""
    trainer = _as_dict(data.get("trainer"))
    given = trainer.get("output_dir") if isinstance(trainer, dict) else None
    return given if _is_set(given) else "outputs"


def _paths(data: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every key in nested input data (list items by index: ``orchestrator.env.0.id``)."""
    data = _as_dict(data)
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    out = []
    for key, value in items:
        path = f"{prefix}{key}"
        out.append(path)
        out += _paths(value, f"{path}.")
    return out


def _keep_paths(data: Any, paths: frozenset[str], prefix: str) -> Any:
    """``data`` with only the keys at ``paths`` (a list's items keep their length: only their keys are filtered)."""
    if isinstance(data, list):
        return [_keep_paths(item, paths, f"{prefix}{i}.") for i, item in enumerate(data)]
    if not isinstance(data, dict):
        return data
    return {
        key: _keep_paths(value, paths, f"{prefix}{key}.")
        for key, value in data.items()
        if f"{prefix}{key}" in paths and value is not None
    }


class RLConfig(BaseConfig):
    """``rl``: start inference, orchestrator and trainer on this node, wired together, and watch them."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer config (``[trainer]`` table or ``--trainer @ train.toml``)."""
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    """Orchestrator config (``[orchestrator]`` table or ``--orchestrator @ orch.toml``)."""
    inference: InferenceConfig | None = None
    """Inference server config. Unset: no server is started; the orchestrator uses the one at
    ``orchestrator.client.base_urls`` (started separately)."""
    teacher: TeacherServerConfig | None = None
    """A frozen teacher server for on-policy distillation, started beside the policy's: every env with ``distill`` and
    no ``teacher.base_url`` scores with it. Unset: no teacher is started (a distilling env names its server)."""

    model: ModelConfig | None = None
    """Shared: model of all three processes."""
    output_dir: Path | None = None
    """Shared: run directory (configs/, logs/, rollouts/, weights/, checkpoints/, metrics.jsonl); replaces the
    process configs' ``output_dir``. Unset: the trainer's ``output_dir`` (default ``outputs``)."""
    seq_len: int | None = Field(default=None, ge=2, le=MAX_SEQ_LEN)
    """Shared: tokens per packed row (trainer and orchestrator)."""
    max_steps: int | None = Field(default=None, ge=1)
    """Shared: number of training steps (trainer and orchestrator)."""
    async_level: int | None = Field(default=None, ge=0)
    """Shared: how many steps rollouts may lag the trainer (trainer and orchestrator). Unset: 1, or with
    ``max_off_policy_steps`` K set here, K - 1 (at least 1, at most K)."""
    max_off_policy_steps: int | None = Field(default=None, ge=0)
    """Shared: continuous rollouts with this bound on each rollout's staleness (orchestrator; the server rl starts
    then updates weights in flight)."""
    seed: Seed | None = None
    """Shared: seed of all three processes."""
    ckpt: CheckpointConfig | None = None
    """Shared: checkpoint interval, retention and resume step (trainer and orchestrator)."""
    log: LogConfig | None = None
    """Shared: log level of all three processes."""
    transport: RolloutTransportConfig | None = None
    """Shared: rollout transport (trainer and orchestrator)."""
    wandb: WandbConfig | None = None
    """Shared: W&B for trainer and orchestrator (``monitor.wandb``). Setting any field enables it; the run
    names get the suffixes -trainer and -orchestrator."""

    runs: list[RLRunConfig] = Field(default_factory=list)
    """Multi-tenant LoRA (needs ``model.lora``): one trainer process trains one adapter per run (its ``runs``),
    one inference server serves them all, and each run gets its own orchestrator. ``output_dir`` then holds the
    trainer's checkpoints and every process's configs and logs. Empty: a single run in ``output_dir``."""

    devices: DevicesConfig = Field(default_factory=DevicesConfig)
    """Device assignment."""
    overwrite: bool = False
    """Start afresh in an output directory that holds another run: its configs, logs, metrics, rollouts,
    weights and checkpoints are deleted first."""
    resume: bool = False
    """Resume the run in ``output_dir`` from its newest checkpoint (``ckpt.resume_step`` picks another)."""
    health_timeout: float = Field(default=900.0, gt=0)
    """Seconds to wait for the inference server's ``/health`` before giving up."""
    liveness: LivenessConfig = Field(default_factory=LivenessConfig)
    """The watchdog that finds a process that is alive but stuck (docs/liveness.md)."""
    stop_grace: float = Field(default=5.0, gt=0, le=8)
    """On shutdown, seconds between SIGTERM and SIGKILL of the process groups."""
    max_log_mb: int = Field(default=1024, ge=1, le=1 << 20)
    """Each process's log (``logs/<process>.log``) past this many MiB moves to ``<process>.log.1``, replacing the one
    before, and starts again: a run's logs hold at most twice this per process, whatever a process (or an environment,
    tool or library it runs) writes."""
    console: Literal["progress", "logs", "quiet"] = "progress"
    """Console output: a live step/reward/throughput line, every process's log lines, or launcher messages only."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for every process (CUDA_VISIBLE_DEVICES and PRIME_RUN_ID are the launcher's)."""

    _user_set: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _share_and_note_user_set(cls, data: Any, handler: Any) -> RLConfig:
        if not isinstance(data, dict):
            return handler(data)
        data = _share(data)
        config = handler(data)
        config._user_set = frozenset(_paths(data))
        config._check_served_adapters()
        return config

    def _check_served_adapters(self) -> None:
        """Every run's adapter is served at once: a limit the user set must allow it (an unset ``max_loras`` is
        raised to the number of runs by the resolver)."""
        if not self.runs or self.inference is None:
            return
        serving, num_runs = self.inference.lora, len(self.runs)
        if serving.max_cpu_loras is not None and serving.max_cpu_loras < num_runs:
            raise ValueError(f"inference.lora.max_cpu_loras ({serving.max_cpu_loras}) < number of runs ({num_runs})")
        if num_runs > serving.max_loras and self.user_set("inference.lora.max_loras"):
            raise ValueError(
                f"inference.lora.max_loras ({serving.max_loras}) < number of runs ({num_runs}): "
                "every run's adapter is sampled at once"
            )

    def user_set(self, path: str) -> bool:
        """Whether the user gave the dotted field ``path`` (a shared field counts for every section it fills), read
        once from the input: a re-validated copy of a section reports every field as set, and the resolver derives
        only what the user left unset."""
        return path in self._user_set

    @property
    def base_urls_given(self) -> bool:
        """Whether the user named the orchestrator's inference servers (else rl points it at the one it starts)."""
        return self.user_set("orchestrator.client.base_urls") or self.user_set("orchestrator.client.base_url")

    def user_input(self) -> dict[str, Any]:
        """What the user set, as JSON-ready data (a resolved config's other fields left out): the ``rl.toml`` that
        reproduces this config elsewhere."""
        return _keep_paths(self.model_dump(mode="json"), self._user_set, "")

    def run_dirs(self) -> dict[str, Path]:
        """Multi-tenant LoRA: each run's directory by run name (default ``<output_dir>/runs/<name>``)."""
        return {run.name: Path(run.output_dir or self.run_dir / "runs" / run.name) for run in self.runs}

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        processes = self.processes()
        dirs = {name: Path(cfg.output_dir).resolve() for name, cfg in processes.items() if hasattr(cfg, "output_dir")}
        if len(set(dirs.values())) > 1:
            raise ValueError(f"output_dir differs between processes ({dirs}); set the shared output_dir")
        t, o = self.trainer, self.orchestrator
        if t.max_steps != o.max_steps:
            raise ValueError(f"trainer.max_steps ({t.max_steps}) != orchestrator.max_steps ({o.max_steps})")
        if t.async_level != o.async_level:
            raise ValueError(f"trainer.async_level ({t.async_level}) != orchestrator.async_level ({o.async_level})")
        if t.seq_len < o.seq_len:
            raise ValueError(f"trainer.seq_len ({t.seq_len}) < orchestrator.seq_len ({o.seq_len})")
        if t.ckpt.interval != o.ckpt.interval or t.ckpt.resume_step != o.ckpt.resume_step:
            raise ValueError("trainer.ckpt and orchestrator.ckpt must agree on interval and resume_step; set ckpt.*")
        if self.inference is not None and self.inference.model.name != o.model.name:
            raise ValueError(
                f"inference.model.name ({self.inference.model.name!r}) != orchestrator.model.name "
                f"({o.model.name!r}); set the shared model.name"
            )
        if t.model.name != o.model.name:
            raise ValueError(f"trainer.model.name ({t.model.name!r}) != orchestrator.model.name ({o.model.name!r})")
        loras = {name: cfg.model.lora for name, cfg in processes.items() if hasattr(cfg, "model")}
        if len({lora is None for lora in loras.values()}) > 1:
            with_lora = sorted(name for name, lora in loras.items() if lora is not None)
            raise ValueError(f"only {', '.join(f'{n}.model.lora' for n in with_lora)} is set: the trainer publishes "
                             "adapters that every process must expect; set the shared model.lora")  # fmt: skip
        max_model_len = self.inference.max_model_len if self.inference is not None else None
        if max_model_len is not None and max_model_len <= o.sampling.max_tokens:
            raise ValueError(f"inference.max_model_len ({max_model_len}) <= orchestrator.sampling.max_tokens "
                             f"({o.sampling.max_tokens}): the server would refuse every request")  # fmt: skip
        inference_threads = self.devices.cpu_threads.get("inference")
        engine_threads = self.inference.torch.num_threads if self.inference is not None else None
        if None not in (inference_threads, engine_threads) and inference_threads != engine_threads:
            raise ValueError(
                f"devices.cpu_threads.inference ({inference_threads}) != inference.torch.num_threads "
                f"({engine_threads}); set one of them"
            )
        bad = next((f"{k!r}" for k, v in self.env_vars.items() if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)), None)
        bad = bad or next((f"{k}'s value (a NUL)" for k, v in self.env_vars.items() if "\x00" in v), None)
        if bad:  # os.execve's "illegal environment variable name" or "embedded null byte", naming nothing
            raise ValueError(f"env_vars: {bad} cannot be set in a process's environment")
        protected = PROTECTED_ENV_VARS & set(self.env_vars)
        if protected:
            raise ValueError(f"env_vars may not set {sorted(protected)}: the launcher sets them per process")
        if self.overwrite and self.resume:
            raise ValueError("overwrite and resume exclude each other")
        if t.runs:
            raise ValueError("trainer.runs is filled by rl, which starts one orchestrator per run: set runs instead")
        if self.runs:
            self._check_runs()
        self._check_teacher()
        return self

    def distilling_envs(self) -> list[tuple[str, EnvConfig]]:
        """(dotted path, env) of every env (``[[runs]]`` ones too) that distils from the teacher ``rl`` starts."""
        lists = {"orchestrator.env": self.orchestrator.env}
        lists |= {f"runs.{i}.env": run.env for i, run in enumerate(self.runs) if run.env is not None}
        return [
            (f"{where}.{i}", env)
            for where, envs in lists.items()
            for i, env in enumerate(envs)
            if env.distill is not None and env.distill.teacher.base_url is None
        ]

    def _check_teacher(self) -> None:
        served = self.distilling_envs()
        if served and self.teacher is None:
            raise ValueError(
                f"{served[0][0]}.distill.teacher.base_url is unset: add a [teacher] section for rl to serve the "
                "teacher, or point base_url at a running one"
            )
        if self.teacher is not None and not served:
            raise ValueError(
                "[teacher] is set but no env distills from it: add [orchestrator.env.distill] to an env (and leave its "
                "teacher.base_url unset)"
            )
        if self.teacher is not None and self.inference is not None and self.teacher.port == self.inference.server.port:
            raise ValueError(f"teacher.port ({self.teacher.port}) is the inference server's port; choose another")

    def _check_runs(self) -> None:
        t = self.trainer
        if t.model.lora is None:
            raise ValueError("runs (multi-tenant LoRA) needs model.lora: every run trains its own adapter")
        names = [run.name for run in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"runs: names must be unique, got {names}")
        dirs = [run_dir.resolve() for run_dir in self.run_dirs().values()]
        if len(set(dirs)) != len(dirs) or self.run_dir.resolve() in dirs:
            raise ValueError("runs: every run needs its own output_dir, distinct from the shared output_dir")
        if t.transport.type != "filesystem" or self.orchestrator.transport.type != "filesystem":
            raise ValueError(
                "runs: the trainer reads each run's rollouts from the run's directory; use transport.type = 'filesystem'"
            )

    def processes(self) -> dict[str, BaseModel]:
        """The process configs that will run, in start order (inference first)."""
        out: dict[str, BaseModel] = {}
        if self.inference is not None:
            out["inference"] = self.inference
        out["orchestrator"] = self.orchestrator
        out["trainer"] = self.trainer
        return out

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir)
