"""The run resolver: ``resolve(rl, facts)`` turns the user's ``RLConfig`` and facts about the machine (or the
nodes of a SLURM job) into every process's validated config, its command, devices and environment, and the notes
the launcher prints. ``rl``, ``rl --dry-run`` and ``prime-launch slurm`` all call it; it reads nothing but its
arguments (``prime_launch.host`` gathers the facts), so its output is a golden file (tests/launch/goldens).

Everything one process's config takes from another's or from where it runs is derived here, once, in the
function of that process: ``_inference_config``, then ``_trainer_config`` (which may depend on the inference
server's size), then ``_orchestrator_config`` (which depends on both). A new cross-process option is one more
line in one of them. Configs are derived with ``BaseConfig.derive`` (typed fields, re-validated); what the user
set is read from ``RLConfig.user_set``, recorded once from the input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prime_core.config.inference import InferenceConfig
from prime_core.config.orchestrator import ClientConfig, OrchestratorConfig
from prime_core.config.rl import RLConfig
from prime_core.config.trainer import LoRARunConfig, TrainerConfig
from prime_core.run_dir import RunDir
from pydantic import BaseModel

from prime_launch.host import ClusterFacts, HostFacts
from prime_launch.placement import Placement, place_on_cluster, place_on_host
from prime_launch.plan import orchestrator_name, role
from prime_launch.process import ProcessSpec
from prime_launch.teacher import TEACHER, teacher_config, teacher_url, with_teacher


@dataclass
class ResolvedRun:
    """Everything a launch starts, in start order, plus what it waits for and what it tells the user."""

    run_dir: RunDir
    configs: dict[str, BaseModel]
    """Each process's config by process name (``orchestrator-<run>`` per run under ``[[runs]]``)."""
    specs: list[ProcessSpec]
    """Each process's command, environment and log (empty for a multi-node job: its script starts them)."""
    health_urls: list[str]
    """``/health`` URLs to wait for before the trainer starts."""
    api_key: str | None
    devices: dict[str, str]
    """Per process, a description of its devices (for messages)."""
    resume_step: int | None = None
    notes: list[str] = field(default_factory=list)
    runs: dict[str, RunDir] = field(default_factory=dict)
    """Multi-tenant LoRA: each run's directory, by run name (its orchestrator is ``orchestrator-<name>``)."""
    teacher_health_url: str | None = None
    """``/health`` of the distillation teacher rl starts (``[teacher]``), waited for before the trainer starts."""
    teacher_after_inference: bool = False
    """The teacher shares a GPU with the policy's server: it starts once that server is healthy (one vLLM at a time
    sizes its memory)."""

    @property
    def orchestrators(self) -> list[str]:
        """Names of the orchestrator processes."""
        return [orchestrator_name(run) for run in self.runs] if self.runs else ["orchestrator"]

    @property
    def name_width(self) -> int:
        """Column width that aligns messages listing the processes."""
        return max([13, *(len(spec.name) + 2 for spec in self.specs)])


def resolve(rl: RLConfig, facts: HostFacts | ClusterFacts) -> ResolvedRun:
    """Resolve a run on one host (``HostFacts``) or over a multi-node job (``ClusterFacts``). Raises ``ValueError``
    for impossible requests and ``FileNotFoundError`` for a missing entry point."""
    local = isinstance(facts, HostFacts)
    place = place_on_host(rl, facts) if local else place_on_cluster(rl, facts)
    run_dir = RunDir(rl.run_dir if local else facts.output_dir)
    resume_step = _resume_step(rl, facts.checkpoint_steps, run_dir)
    inference = _inference_config(rl, place, run_dir)
    teacher = teacher_config(rl, place, run_dir)
    trainer = _trainer_config(rl, place, inference, run_dir, resume_step)
    if not local and facts.num_trainer_nodes > 1 and trainer.transport.type == "zmq":
        # The orchestrator, beside trainer rank 0, reaches the other trainer nodes' ranks over the network (the job
        # script gives it their hosts); a single trainer node keeps its ranks on loopback.
        trainer = trainer.derive(transport=trainer.transport.derive(bind_host="0.0.0.0"))
    environ = facts.environ if local else {}
    orchestrator = _orchestrator_config(rl, place, trainer, inference, run_dir, resume_step, environ)
    orchestrator = orchestrator.derive(env=with_teacher(orchestrator.env, teacher, rl.health_timeout))
    configs = _process_configs(rl, inference, teacher, orchestrator, trainer, place.devices)
    api_key = _api_key(orchestrator.client, inference, environ)
    return ResolvedRun(
        run_dir=run_dir,
        configs=configs,
        specs=_process_specs(rl, configs, run_dir, place, facts) if local else [],
        health_urls=[url.rstrip("/").removesuffix("/v1") + "/health" for url in orchestrator.client.base_urls],
        api_key=api_key,
        devices=place.devices,
        resume_step=resume_step,
        notes=place.notes,
        runs={name: RunDir(path) for name, path in rl.run_dirs().items()},
        teacher_health_url=teacher_url(teacher) + "/health" if teacher is not None else None,
        teacher_after_inference=place.teacher_shares_gpu,
    )


def _resume_step(rl: RLConfig, checkpoint_steps: tuple[int, ...], run_dir: RunDir) -> int | None:
    """The step both sides resume from: ``ckpt.resume_step``, else with ``--resume`` the newest checkpoint."""
    resume_step = rl.trainer.ckpt.resume_step
    if rl.resume and resume_step is None:
        if not checkpoint_steps:
            raise ValueError(_nothing_to_resume(rl, run_dir))
        resume_step = checkpoint_steps[-1]
        if resume_step >= rl.trainer.max_steps:
            raise ValueError(
                f"--resume: the newest checkpoint (step {resume_step}) is at max-steps {rl.trainer.max_steps}: the run "
                "is finished; raise --max-steps to train on"
            )
    return resume_step


def _nothing_to_resume(rl: RLConfig, run_dir: RunDir) -> str:
    """Why ``--resume`` finds no checkpoint, and what to do: before, a run that had finished, or saved none because
    ``ckpt.interval`` was unset, was told only that there was no checkpoint."""
    latest = run_dir.latest_stable_weight_step()
    if latest is not None and latest >= rl.trainer.max_steps:
        return (f"--resume: the run in {run_dir.root} has finished (final weights {run_dir.weight_step(latest)}) and "
                "kept no checkpoint to train on from; --overwrite starts it afresh")  # fmt: skip
    if rl.trainer.ckpt.interval is None:
        why = "none is saved with ckpt.interval unset; set --ckpt.interval N for a run you may resume"
    else:
        why = "a checkpoint counts once its trainer and orchestrator parts and the weights of its step are complete"
    return (f"--resume: no checkpoint under {run_dir.checkpoints} to resume from ({why}); --overwrite starts the run "
            "afresh")  # fmt: skip


def _inference_config(rl: RLConfig, place: Placement, run_dir: RunDir) -> InferenceConfig | None:
    """The server's engine and GPUs as placed, where it binds, which weights it may read, how many adapters."""
    inference = rl.inference if place.num_inference_servers else None
    if inference is None:
        return None
    vllm, server, lora = inference.vllm, inference.server, inference.lora
    if place.inference_data_parallel is not None:
        vllm = vllm.derive(data_parallel_size=place.inference_data_parallel)
    if place.shares is not None:
        vllm = vllm.derive(gpu_memory_utilization=place.shares.inference_fraction)
    roots = list(server.weight_roots)
    if place.server_address is not None:  # reached from other nodes: bind every interface, confined to the run
        host, port = place.server_address
        server = server.derive(host=host, port=port, weight_roots=roots or [run_dir.weights])
    if rl.runs and roots:  # a server confined to weight roots must still read every run's adapters
        roots += [RunDir(path).weights for path in rl.run_dirs().values()]
        server = server.derive(weight_roots=roots)
    if len(rl.runs) > lora.max_loras and not rl.user_set("inference.lora.max_loras"):
        lora = lora.derive(max_loras=len(rl.runs))  # every run's adapter is sampled at once
    engine = place.inference_engine or inference.engine
    # The trainer recomputes the distribution each token was drawn from (temperature included): rollouts carry
    # processed log-probs, where a standalone `inference` keeps vLLM's raw default.
    mode = inference.logprobs_mode if rl.user_set("inference.logprobs_mode") else "processed"
    # Continuous rollouts: an update must not wait for the long tail of running rollouts.
    update = inference.weight_update
    if rl.orchestrator.max_off_policy_steps is not None and not rl.user_set("inference.weight_update"):
        update = "in_flight"
    return inference.derive(output_dir=run_dir.root, engine=engine, vllm=vllm, server=server, lora=lora,
                            logprobs_mode=mode, weight_update=update)  # fmt: skip


def _trainer_config(
    rl: RLConfig, place: Placement, inference: InferenceConfig | None, run_dir: RunDir, resume_step: int | None
) -> TrainerConfig:
    """The trainer's device and memory share as placed, how its weights reach the servers, resume step, runs."""
    trainer = rl.trainer
    broadcast = trainer.weights.broadcast
    if place.weights_transport is not None:  # a shared GPU (prime_launch.colocate.shared_gpu_transport)
        broadcast = broadcast.derive(type=place.weights_transport)
    if broadcast.type == "nccl" and inference is not None and inference.engine == "vllm" and inference.vllm.engines > 1:
        raise ValueError(
            f"inference.vllm.engines = {inference.vllm.engines} puts several vLLM workers on one GPU, which an NCCL "
            "weight broadcast cannot hold: use trainer.weights.broadcast.type cuda_ipc (a GPU shared with the "
            "trainer) or filesystem"
        )
    if broadcast.one_time and inference is not None:
        workers = _broadcast_workers(inference, place.num_inference_servers)
        if not rl.user_set("trainer.weights.broadcast.inference_workers"):
            broadcast = broadcast.derive(inference_workers=workers)
        elif broadcast.inference_workers != workers:
            raise ValueError(
                f"trainer.weights.broadcast.inference_workers ({broadcast.inference_workers}) != the inference "
                f"servers' workers ({workers} = servers x tensor_parallel_size x data_parallel_size x engines)"
            )
    changes: dict = {"output_dir": run_dir.root, "weights": trainer.weights.derive(broadcast=broadcast)}
    if place.trainer_device is not None:
        changes["device"] = place.trainer_device
    if place.shares is not None:
        changes["gpu_memory_fraction"] = place.shares.trainer_fraction
    if resume_step is not None:
        changes["ckpt"] = trainer.ckpt.derive(resume_step=resume_step)
    if rl.runs:
        lrs = {run.name: run.lr for run in rl.runs}
        changes["runs"] = [LoRARunConfig(name=n, output_dir=d, lr=lrs[n]) for n, d in rl.run_dirs().items()]
    return trainer.derive(**changes)


def _broadcast_workers(inference: InferenceConfig, num_servers: int) -> int:
    """Inference workers that join a weight broadcast: one per GPU of each vLLM engine, one per torch-engine server."""
    if inference.engine == "torch":
        return num_servers
    v = inference.vllm
    return num_servers * v.tensor_parallel_size * v.data_parallel_size * v.engines


def _orchestrator_config(
    rl: RLConfig,
    place: Placement,
    trainer: TrainerConfig,
    inference: InferenceConfig | None,
    run_dir: RunDir,
    resume_step: int | None,
    environ: Mapping[str, str],
) -> OrchestratorConfig:
    """One file per trainer rank, the weight relay the trainer's transport needs, the server to talk to, resume."""
    orchestrator = rl.orchestrator
    client = orchestrator.client
    if inference is not None and place.server_address is None:
        client = _client_of_own_server(rl, client, inference, _user_key(client, environ))
    if client.server_run_id is not None:  # given on the command line by rl, never kept in a config
        client = client.derive(server_run_id=None)
    changes: dict = {
        "output_dir": run_dir.root,
        "num_trainer_ranks": place.num_trainer_ranks,
        "weights_broadcast": trainer.weights.broadcast.one_time,
        "client": client,
    }
    if resume_step is not None:
        changes["ckpt"] = orchestrator.ckpt.derive(resume_step=resume_step)
    return orchestrator.derive(**changes)


def _client_of_own_server(
    rl: RLConfig, client: ClientConfig, inference: InferenceConfig, user_key: str | None
) -> ClientConfig:
    """The orchestrator talks to the server rl starts (or the one the user named, on the same port), with its key,
    and waits for it as long as rl does (rl starts it beside the server)."""
    host, port = inference.server.host, inference.server.port
    connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if port == 0:
        raise ValueError("inference.server.port = 0 (a free port) cannot be wired to the orchestrator; set a port")
    changes: dict = {"health_timeout": max(client.health_timeout, rl.health_timeout)}
    if rl.base_urls_given:
        for url in client.base_urls:
            if _url_port(url) != port:
                raise ValueError(
                    f"orchestrator.client.base-urls {url!r} does not point at the inference server rl starts "
                    f"(port {port}); drop the base URL or give both the same port"
                )
    else:
        changes["base_urls"] = [f"http://{connect}:{port}"]
    if inference.server.api_key and user_key is None:
        changes["api_key"] = inference.server.api_key
    elif inference.server.api_key_var and user_key is None:
        changes["api_key_var"] = inference.server.api_key_var  # the key stays out of the orchestrator's config file
    return client.derive(**changes)


def _url_port(url: str) -> int | None:
    from urllib.parse import urlparse

    return urlparse(url if "://" in url else f"http://{url}").port


def _user_key(client: ClientConfig, environ: Mapping[str, str]) -> str | None:
    """The orchestrator's API key: ``api_key``, else the variable ``api_key_var`` names (children inherit it)."""
    if client.api_key is not None:
        return client.api_key
    return environ.get(client.api_key_var) if client.api_key_var else None


def _api_key(client: ClientConfig, inference: InferenceConfig | None, environ: Mapping[str, str]) -> str | None:
    """The key the launcher's own requests (health, weight resets) carry."""
    server = inference.server if inference is not None else None
    own = server.api_key or environ.get(server.api_key_var or "") if server is not None else None
    return own or _user_key(client, environ)


def _run_orchestrators(
    rl: RLConfig, orchestrator: OrchestratorConfig, teacher: InferenceConfig | None
) -> dict[str, OrchestratorConfig]:
    """One orchestrator per run: the run's directory, adapter name and overrides on the resolved base config."""
    if not rl.runs:
        return {"orchestrator": orchestrator}
    out = {}
    run_dirs = rl.run_dirs()
    for run in rl.runs:
        model = orchestrator.model
        assert model.lora is not None  # RLConfig checks that runs have model.lora
        changes: dict = {"output_dir": run_dirs[run.name], "model": model.derive(lora=model.lora.derive(name=run.name))}
        if run.seed is not None:
            changes["seed"] = run.seed
        if run.env is not None:
            changes["env"] = with_teacher(run.env, teacher, rl.health_timeout)
        wandb = orchestrator.monitor.wandb
        if wandb.name:
            changes["monitor"] = orchestrator.monitor.derive(wandb=wandb.derive(name=f"{wandb.name}-{run.name}"))
        out[orchestrator_name(run.name)] = orchestrator.derive(**changes)
    return out


def _process_configs(
    rl: RLConfig,
    inference: InferenceConfig | None,
    teacher: InferenceConfig | None,
    orchestrator: OrchestratorConfig,
    trainer: TrainerConfig,
    devices: dict[str, str],
) -> dict[str, BaseModel]:
    """Each process's config in start order, by process name; ``devices`` gets an entry per process."""
    configs: dict[str, BaseModel] = {}
    if inference is not None:
        configs["inference"] = inference
    if teacher is not None:
        configs[TEACHER] = teacher
    configs.update(_run_orchestrators(rl, orchestrator, teacher))
    configs["trainer"] = trainer
    for name in configs:
        devices.setdefault(name, devices[role(name)])
    if rl.runs:
        del devices["orchestrator"]
    return configs


def _process_specs(
    rl: RLConfig, configs: dict[str, BaseModel], run_dir: RunDir, place: Placement, facts: HostFacts
) -> list[ProcessSpec]:
    """Each process's command line, environment (devices, threads, run id) and log file."""
    common_env = {"PYTHONUNBUFFERED": "1", "PRIME_RUN_ID": facts.run_id, **rl.env_vars}
    specs = []
    for name in configs:
        # Each child logs to stdout only: the launcher redirects stdout into logs/<name>.log.
        args = ["@", str(run_dir.config_file(name)), "--log.file", "false"]
        if role(name) == "orchestrator" and "inference" in configs:
            # Started beside rl's own server: it sends nothing until /health carries this run's id.
            args += ["--client.server-run-id", facts.run_id]
        cmd = [_executable(facts, "inference" if name == TEACHER else role(name)), *args]
        if name == "trainer" and place.num_trainer_ranks > 1:
            ranks = str(place.num_trainer_ranks)
            # --log-dir /dev/null: torchrun otherwise leaves a /tmp/torchelastic_* directory behind every launch (the
            # ranks' output goes to the trainer's log through stdout anyway).
            cmd = [_executable(facts, "torchrun"), "--standalone", "--nproc-per-node", ranks, "--log-dir", "/dev/null",
                   "--no-python", *cmd]  # fmt: skip
        env = {**common_env, **place.env_of[role(name)]}
        if name == "trainer" and place.use_gpu:
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        specs.append(ProcessSpec(name=name, cmd=cmd, log_file=run_dir.log_file(name), env=env))
    return specs


def _executable(facts: HostFacts, name: str) -> str:
    if name not in facts.executables:
        raise FileNotFoundError(f"cannot find the {name!r} executable (is its package installed in this environment?)")
    return facts.executables[name]
