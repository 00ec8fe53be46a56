"""Turn an ``RLConfig`` into a launch plan: resolved per-process configs, devices, commands, environments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prime_core.config.inference import InferenceConfig
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.config.rl import RLConfig
from prime_core.config.trainer import TrainerConfig
from prime_core.run_dir import RunDir
from pydantic import BaseModel

from prime_launch.colocate import check_fit, sharing_notes
from prime_launch.cpu_threads import THREAD_ENV_VARS, available_cores, split_cpu_threads
from prime_launch.process import ProcessSpec

BIN_DIR_ENV = "PRIME_LAUNCH_BIN_DIR"
"""Directory searched first for the ``trainer``/``orchestrator``/``inference``/``torchrun`` executables."""

# Run artifacts of a launch; anything else in the output directory is left alone.
RUN_ARTIFACTS = ("configs", "logs", "rollouts", "weights", "checkpoints", "metrics.jsonl", "samples", "eval")
DRY_RUN_MARKER = ".dry-run"


@dataclass
class RunPlan:
    """Everything the launcher starts, in start order, plus what it waits for."""

    run_dir: RunDir
    configs: dict[str, BaseModel]
    specs: list[ProcessSpec]
    health_urls: list[str]
    """``/health`` URLs to wait for before the orchestrator starts."""
    api_key: str | None
    devices: dict[str, str]
    """Per process, a description of its devices (for messages)."""
    resume_step: int | None = None
    notes: list[str] = field(default_factory=list)
    runs: dict[str, RunDir] = field(default_factory=dict)
    """Multi-tenant LoRA: each run's directory, by run name (its orchestrator is ``orchestrator-<name>``)."""

    @property
    def orchestrators(self) -> list[str]:
        """Names of the orchestrator processes."""
        return [orchestrator_name(run) for run in self.runs] if self.runs else ["orchestrator"]

    @property
    def name_width(self) -> int:
        """Column width that aligns messages listing the processes."""
        return max(13, *(len(spec.name) + 2 for spec in self.specs))


def orchestrator_name(run: str) -> str:
    return f"orchestrator-{run}"


def role(process: str) -> str:
    """The entry point of a process (``orchestrator-<run>`` runs ``orchestrator``)."""
    return "orchestrator" if process.startswith("orchestrator") else process


def run_orchestrators(rl: RLConfig, orchestrator: OrchestratorConfig) -> dict[str, OrchestratorConfig]:
    """One orchestrator per run: the run's directory, adapter name and overrides on the resolved base config."""
    if not rl.runs:
        return {"orchestrator": orchestrator}
    out = {}
    for run in rl.runs:
        cfg = _update(orchestrator, "output_dir", run.output_dir)
        cfg = _update(cfg, "model.lora.name", run.name)
        if run.seed is not None:
            cfg = _update(cfg, "seed", run.seed)
        if run.env is not None:
            cfg = _update(cfg, "env", [env.model_dump() for env in run.env])
        if cfg.monitor.wandb.name:
            cfg = _update(cfg, "monitor.wandb.name", f"{cfg.monitor.wandb.name}-{run.name}")
        out[orchestrator_name(run.name)] = cfg
    return out


def find_executable(name: str, environ: Mapping[str, str] | None = None) -> str:
    """An entry point of this environment: the override dir, then next to the interpreter, then PATH."""
    environ = os.environ if environ is None else environ
    dirs = [environ[BIN_DIR_ENV]] if environ.get(BIN_DIR_ENV) else []
    dirs.append(str(Path(sys.executable).parent))
    for d in dirs:
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"cannot find the {name!r} executable (is its package installed in this environment?)")
    return found


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[int]:
    """GPU ids from ``CUDA_VISIBLE_DEVICES``, else counted with ``nvidia-smi -L``; [] without GPUs."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if not ids or ids == ["-1"]:
            return []
        try:
            return [int(v) for v in ids]
        except ValueError:  # GPU UUIDs: use positions (children see them renumbered anyway)
            return list(range(len(ids)))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return list(range(sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))))


def _update(model: BaseModel, path: str, value: Any) -> BaseModel:
    """A copy of ``model`` with the dotted field ``path`` set (re-validated)."""
    data = model.model_dump(mode="python")
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return type(model).model_validate(data)


def _url_port(url: str) -> tuple[str, int | None]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return parsed.hostname or "", parsed.port


def latest_checkpoint_step(run_dir: RunDir, runs: list[RunDir] | None = None) -> int | None:
    steps = run_dir.resumable_steps(runs or [])
    return steps[-1] if steps else None


@dataclass
class _Placement:
    """Where each role runs: the outcome of the devices section of `build_plan`."""

    use_gpu: bool
    num_trainer_ranks: int
    env_of: dict[str, dict[str, str]]
    """Per role, the environment variables its devices and threads need."""
    devices: dict[str, str]
    """Per role, a description of its devices (for messages)."""


def colocated(rl: RLConfig, gpus: list[int]) -> bool:
    """Whether inference and trainer share GPUs: as ``devices.colocate`` says, else when one GPU is all there is."""
    if rl.inference is None:
        return False
    return rl.devices.colocate if rl.devices.colocate is not None else len(gpus) == 1


def _place_on_gpus(
    rl: RLConfig,
    gpus: list[int],
    trainer: TrainerConfig,
    inference: InferenceConfig | None,
    notes: list[str],
    environ: Mapping[str, str],
) -> tuple[_Placement, TrainerConfig, InferenceConfig | None]:
    env_of: dict[str, dict[str, str]] = {"inference": {}, "orchestrator": {"CUDA_VISIBLE_DEVICES": ""}, "trainer": {}}
    devices: dict[str, str] = {}
    num_inf = rl.devices.num_inference_gpus if inference is not None else 0
    num_train = rl.devices.num_trainer_gpus
    shared = colocated(rl, gpus)
    if rl.devices.colocate and inference is None:
        notes.append("devices.colocate: rl starts no inference server here, so the trainer has its GPUs to itself")
    if shared and max(num_inf, num_train) > len(gpus):
        raise ValueError(
            f"devices.colocate: {num_inf} inference and {num_train} trainer GPUs requested but only {len(gpus)} "
            f"available ({gpus}); lower devices.num_inference_gpus / devices.num_trainer_gpus"
        )
    if not shared and num_inf + num_train > len(gpus):
        raise ValueError(
            f"{num_inf} inference + {num_train} trainer GPUs requested but only {len(gpus)} available ({gpus}); "
            "lower devices.num_inference_gpus / devices.num_trainer_gpus, set devices.gpu_ids, or share GPUs "
            "with devices.colocate = true"
        )
    inf_ids = gpus[:num_inf]
    train_ids = gpus[:num_train] if shared else gpus[num_inf : num_inf + num_train]
    env_of["trainer"]["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, train_ids))
    trainer = _update(trainer, "device", "cuda") if trainer.device == "auto" else trainer
    devices["trainer"] = f"GPU {','.join(map(str, train_ids))}"
    if inference is not None:
        env_of["inference"]["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, inf_ids))
        devices["inference"] = f"GPU {','.join(map(str, inf_ids))}"
        if shared:
            trainer, inference = _share_gpus(rl, trainer, inference, train_ids, devices, notes, environ)
        tp = inference.vllm.tensor_parallel_size
        if num_inf % tp:
            raise ValueError(f"devices.num_inference_gpus ({num_inf}) is not a multiple of tensor_parallel_size ({tp})")
        if inference.vllm.data_parallel_size == 1 and num_inf // tp > 1:
            inference = _update(inference, "vllm.data_parallel_size", num_inf // tp)
            notes.append(f"inference: data parallel size {num_inf // tp} (x tensor parallel {tp})")
    return _Placement(True, num_train, env_of, devices), trainer, inference


def _share_gpus(
    rl: RLConfig,
    trainer: TrainerConfig,
    inference: InferenceConfig,
    train_ids: list[int],
    devices: dict[str, str],
    notes: list[str],
    environ: Mapping[str, str],
) -> tuple[TrainerConfig, InferenceConfig]:
    """Colocated configs: vLLM's memory share and weights by files, once the trainer is known to fit beside vLLM."""
    micro_batch_tokens = rl.orchestrator.micro_batch_rows * rl.orchestrator.seq_len
    shares = check_fit(rl.devices, trainer, len(train_ids), train_ids, environ, micro_batch_tokens)
    notes += sharing_notes(shares, trainer, inference)
    inference = _update(inference, "vllm.gpu_memory_utilization", shares.inference_fraction)
    trainer = _update(trainer, "gpu_memory_fraction", shares.trainer_fraction)
    if trainer.weights.broadcast.type == "nccl":
        trainer = _update(trainer, "weights.broadcast.type", "filesystem")
    for role_name in ("inference", "trainer"):
        devices[role_name] += f" {shares.describe(role_name)}"
    return trainer, inference


def _place_on_cpu(
    rl: RLConfig, trainer: TrainerConfig, inference: InferenceConfig | None
) -> tuple[_Placement, TrainerConfig, InferenceConfig | None]:
    env_of: dict[str, dict[str, str]] = {"inference": {}, "orchestrator": {"CUDA_VISIBLE_DEVICES": ""}, "trainer": {}}
    env_of["trainer"]["CUDA_VISIBLE_DEVICES"] = ""
    if trainer.device == "cuda":
        raise ValueError("trainer.device = cuda but no GPU is visible")
    trainer = _update(trainer, "device", "cpu")
    num_trainer_ranks = rl.devices.num_cpu_trainer_procs
    devices = {"trainer": f"CPU x{num_trainer_ranks}" if num_trainer_ranks > 1 else "CPU"}
    if inference is not None:
        env_of["inference"]["CUDA_VISIBLE_DEVICES"] = ""
        devices["inference"] = "CPU (torch engine)"
        if inference.engine == "vllm":
            raise ValueError("inference.engine = vllm needs a GPU; use engine = torch (or auto) on CPU")
        inference = _update(inference, "engine", "torch")
        if inference.torch.device not in ("auto", "cpu"):
            raise ValueError(f"inference.torch.device = {inference.torch.device} but no GPU is visible")
    return _Placement(False, num_trainer_ranks, env_of, devices), trainer, inference


def _assign_threads(
    rl: RLConfig, inference: InferenceConfig | None, place: _Placement, cores: int | None, environ: Mapping[str, str]
) -> None:
    """Threads of the processes on CPU: an explicit OMP_NUM_THREADS (env_vars or environment) stays for every
    role that devices.cpu_threads does not name."""
    use_gpu, num_trainer_ranks = place.use_gpu, place.num_trainer_ranks
    on_cpu = ["orchestrator"] if use_gpu else ["orchestrator", "trainer", *(["inference"] if inference else [])]
    explicit = dict(rl.devices.cpu_threads)
    if inference is not None and inference.torch.num_threads is not None:
        explicit.setdefault("inference", inference.torch.num_threads)
    inherited = rl.env_vars.get("OMP_NUM_THREADS") or environ.get("OMP_NUM_THREADS")
    threads = split_cpu_threads(
        available_cores() if cores is None else cores,
        inference=not use_gpu and inference is not None,
        trainer_ranks=0 if use_gpu else num_trainer_ranks,
        explicit=explicit,
    )
    for name in on_cpu:
        if inherited and name not in explicit:
            place.devices[name] += f", OMP_NUM_THREADS={inherited} (inherited)"
            continue
        for var in THREAD_ENV_VARS:
            place.env_of[name][var] = str(threads[name])
        per_rank = " per rank" if name == "trainer" and num_trainer_ranks > 1 else ""
        place.devices[name] += f", {threads[name]} thread{'s' if threads[name] > 1 else ''}{per_rank}"


def _wire(
    orchestrator: OrchestratorConfig, inference: InferenceConfig | None, base_urls_given: bool, health_timeout: float
) -> tuple[OrchestratorConfig, str | None, list[str]]:
    """The orchestrator talks to the server rl starts (or the external one it names, ``base_urls_given``). Returns the
    orchestrator config, the API key and the ``/health`` URLs."""
    api_key = orchestrator.client.resolved_api_key()
    if inference is not None:
        host = inference.server.host
        connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        port = inference.server.port
        if port == 0:
            raise ValueError("inference.server.port = 0 (a free port) cannot be wired to the orchestrator; set a port")
        if base_urls_given:
            for url in orchestrator.client.base_urls:
                _, url_port = _url_port(url)
                if url_port != port:
                    raise ValueError(
                        f"orchestrator.client.base-urls {url!r} does not point at the inference server rl starts "
                        f"(port {port}); drop the base URL or give both the same port"
                    )
        else:
            orchestrator = _update(orchestrator, "client.base_urls", [f"http://{connect}:{port}"])
        if inference.server.api_key and api_key is None:
            orchestrator = _update(orchestrator, "client.api_key", inference.server.api_key)
        api_key = inference.server.api_key or api_key
        # rl starts this orchestrator beside the server: it waits for this server as long as rl does (and for this
        # run's id, given on its command line so that the written config stays reusable: _process_specs).
        timeout = max(orchestrator.client.health_timeout, health_timeout)
        orchestrator = _update(orchestrator, "client.health_timeout", timeout)
    if orchestrator.client.server_run_id is not None:
        orchestrator = _update(orchestrator, "client.server_run_id", None)
    health_urls = [url.rstrip("/").removesuffix("/v1") + "/health" for url in orchestrator.client.base_urls]
    return orchestrator, api_key, health_urls


def _resume_step(
    rl: RLConfig, run_dir: RunDir, trainer: TrainerConfig, orchestrator: OrchestratorConfig
) -> tuple[int | None, TrainerConfig, OrchestratorConfig]:
    """The newest checkpoint (or the step given with ckpt.resume_step) on both sides."""
    resume_step = trainer.ckpt.resume_step
    if rl.resume and resume_step is None:
        resume_step = latest_checkpoint_step(run_dir, [RunDir(run.output_dir) for run in rl.runs])
        if resume_step is None:
            raise ValueError(
                f"--resume: no complete checkpoint under {run_dir.checkpoints} (trainer and orchestrator parts and the "
                "weights of its step) to resume from"
            )
        trainer = _update(trainer, "ckpt.resume_step", resume_step)
        orchestrator = _update(orchestrator, "ckpt.resume_step", resume_step)
    return resume_step, trainer, orchestrator


def _process_specs(
    configs: dict[str, BaseModel], run_dir: RunDir, place: _Placement, common_env: dict[str, str], environ
) -> list[ProcessSpec]:
    specs = []
    for name in configs:
        cfg_path = run_dir.config_file(name)
        # Each child logs to stdout only: the launcher redirects stdout into logs/<name>.log.
        args = ["@", str(cfg_path), "--log.file", "false"]
        if role(name) == "orchestrator" and "inference" in configs:
            # Started beside rl's own server: it sends nothing until /health carries this run's id.
            args += ["--client.server-run-id", common_env["PRIME_RUN_ID"]]
        executable = find_executable(role(name), environ)
        if name == "trainer" and place.num_trainer_ranks > 1:
            cmd = [
                find_executable("torchrun", environ),
                "--standalone",
                "--nproc-per-node",
                str(place.num_trainer_ranks),
                "--no-python",
                executable,
                *args,
            ]
        else:
            cmd = [executable, *args]
        env = {**common_env, **place.env_of[role(name)]}
        if name == "trainer" and place.use_gpu:
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        specs.append(ProcessSpec(name=name, cmd=cmd, log_file=run_dir.log_file(name), env=env))
    return specs


def _process_configs(
    rl: RLConfig,
    inference: InferenceConfig | None,
    orchestrator: OrchestratorConfig,
    trainer: TrainerConfig,
    devices: dict[str, str],
) -> dict[str, BaseModel]:
    """Each process's config, by process name (an orchestrator per run under ``[[runs]]``); ``devices`` gets an
    entry per process."""
    if rl.runs:
        runs = [{"name": run.name, "output_dir": run.output_dir, "lr": run.lr} for run in rl.runs]
        trainer = _update(trainer, "runs", runs)
        roots = list(inference.server.weight_roots) if inference is not None else []
        if roots:  # a server confined to weight roots must still read every run's adapters
            roots += [RunDir(run.output_dir).weights for run in rl.runs]
            inference = _update(inference, "server.weight_roots", roots)
    configs: dict[str, BaseModel] = {}
    if inference is not None:
        configs["inference"] = inference
    configs.update(run_orchestrators(rl, orchestrator))
    configs["trainer"] = trainer
    for name in configs:
        devices.setdefault(name, devices[role(name)])
    if rl.runs:
        del devices["orchestrator"]
    return configs


def build_plan(
    rl: RLConfig,
    environ: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    cores: int | None = None,
) -> RunPlan:
    """Resolve devices, threads, wiring and commands. Raises ``ValueError`` for impossible requests.

    ``cores`` defaults to the launcher's affinity mask; ``environ`` to the launcher's environment.
    """
    environ = dict(os.environ if environ is None else environ)
    run_dir = RunDir(rl.run_dir)
    trainer: TrainerConfig = rl.trainer
    inference: InferenceConfig | None = rl.inference
    notes: list[str] = []
    # Read before any update: a re-validated copy marks every field as set.
    base_urls_given = rl.base_urls_given

    # Devices: inference first, then trainer.
    gpus: list[int] = []
    # A trainer pinned to the CPU beside the torch engine is a CPU run (the examples' rl.toml) on a GPU host too.
    cpu_run = trainer.device == "cpu" and (inference is None or inference.engine == "torch")
    if rl.devices.type == "cuda" or (rl.devices.type == "auto" and not cpu_run):
        gpus = list(rl.devices.gpu_ids) if rl.devices.gpu_ids is not None else visible_gpus(environ)
        if rl.devices.type == "cuda" and not gpus:
            raise ValueError("devices.type = cuda but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    if gpus:
        place, trainer, inference = _place_on_gpus(rl, gpus, trainer, inference, notes, environ)
    else:
        place, trainer, inference = _place_on_cpu(rl, trainer, inference)
    place.devices["orchestrator"] = "CPU"
    orchestrator = _update(rl.orchestrator, "num_trainer_ranks", place.num_trainer_ranks)
    if trainer.weights.broadcast.type != "nccl" and orchestrator.weights_broadcast:
        orchestrator = _update(orchestrator, "weights_broadcast", False)  # colocated: weights went back to files
    _assign_threads(rl, inference, place, cores, environ)
    orchestrator, api_key, health_urls = _wire(orchestrator, inference, base_urls_given, rl.health_timeout)
    resume_step, trainer, orchestrator = _resume_step(rl, run_dir, trainer, orchestrator)
    configs = _process_configs(rl, inference, orchestrator, trainer, place.devices)

    run_id = run_id or environ.get("PRIME_RUN_ID") or uuid.uuid4().hex[:12]
    common_env = {"PYTHONUNBUFFERED": "1", "PRIME_RUN_ID": run_id, **rl.env_vars}
    return RunPlan(
        run_dir=run_dir,
        configs=configs,
        specs=_process_specs(configs, run_dir, place, common_env, environ),
        health_urls=health_urls,
        api_key=api_key,
        devices=place.devices,
        resume_step=resume_step,
        notes=notes,
        runs={run.name: RunDir(run.output_dir) for run in rl.runs},
    )


def existing_artifacts(run_dir: RunDir) -> list[str]:
    """Artifacts of another run in ``run_dir`` (a dry run's configs do not count)."""
    found = []
    for name in RUN_ARTIFACTS:
        path = run_dir.root / name
        if name == "configs" and (path / DRY_RUN_MARKER).exists():
            continue
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def trained(run_dir: RunDir) -> bool:
    """Whether the run in ``run_dir`` got through a step: a checkpoint, weights after step 0, a metrics record
    (trainer or orchestrator), samples or evals. A start that failed before that left only disposable artifacts
    (configs, logs, partial step-0 rollouts)."""
    root = run_dir.root
    if any(p.is_dir() and any(p.iterdir()) for p in (run_dir.checkpoints, root / "samples", root / "eval")):
        return True
    if run_dir.weights.is_dir() and any(p.name != "step_0" for p in run_dir.weights.iterdir()):
        return True
    try:
        with open(run_dir.metrics, encoding="utf-8", errors="replace") as f:
            return any(line.strip() for line in f)
    except OSError:
        return False


def check_output_dir(run_dir: RunDir, *, overwrite: bool, resume: bool) -> None:
    """Refuse an output directory holding another run that trained, unless resuming or overwriting."""
    found = existing_artifacts(run_dir)
    if found and not (overwrite or resume) and trained(run_dir):
        raise FileExistsError(
            f"output directory {run_dir.root} holds another run ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to delete it and start afresh, or choose another --output-dir"
        )


def clear_run(run_dir: RunDir) -> None:
    """Delete the artifacts of a previous run (only the names a run writes; nothing else in the directory)."""
    for name in RUN_ARTIFACTS:
        path = run_dir.root / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def command_line(spec: ProcessSpec) -> str:
    """A copy-pasteable shell line for a process (devices and run id included)."""
    import shlex

    shown = {k: v for k, v in spec.env.items() if k in ("CUDA_VISIBLE_DEVICES", "PRIME_RUN_ID", *THREAD_ENV_VARS)}
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
    cmd = " ".join(shlex.quote(c) for c in spec.cmd)
    return f"{prefix} {cmd} > {shlex.quote(str(spec.log_file))} 2>&1" if prefix else cmd
