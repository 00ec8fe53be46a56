"""Prepare SLURM jobs: resolve the configs a job needs, write them to the shared output dir, render the script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w
from prime_core.config import write_config
from prime_core.config.rl import RLConfig
from prime_core.config.slurm import SlurmConfig
from prime_core.io import atomic_write_text
from prime_core.run_dir import RunDir, clear_run
from prime_core.transport import secret_path
from pydantic import BaseModel

from prime_launch.host import ClusterFacts, resumable_steps
from prime_launch.plan import DRY_RUN_MARKER, check_output_dir, orchestrator_name
from prime_launch.resolver import resolve
from prime_launch.slurm import SlurmJob, base_context, choose_template, render
from prime_launch.watchdog import watch_context


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _mark(run_dir: RunDir, dry_run: bool) -> None:
    marker = run_dir.configs / DRY_RUN_MARKER
    run_dir.configs.mkdir(parents=True, exist_ok=True)
    if dry_run:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)


def prepare(kind: str, config: BaseModel, *, dry_run: bool) -> SlurmJob:
    """Write the job's configs and its script under ``<output_dir>``; return the rendered job."""
    slurm: SlurmConfig = config.slurm  # type: ignore[attr-defined]
    template = choose_template(kind, slurm)
    if kind == "rl":
        return _prepare_rl(config, slurm, template, dry_run)  # an RLConfig with a [slurm] section
    return _prepare_sft(config, slurm, template, dry_run)


def _prepare_rl(rl: RLConfig, slurm: SlurmConfig, template: str, dry_run: bool) -> SlurmJob:
    """One node: the job runs ``rl`` on what the user set (resolved there, on the node's facts). More nodes: the
    configs resolved here for the job's nodes, started by the script."""
    output_dir = rl.run_dir.resolve()
    run_dir = RunDir(output_dir)
    check_output_dir(run_dir, overwrite=rl.overwrite, resume=rl.resume)
    num_trainer_nodes = slurm.rl_num_trainer_nodes
    num_nodes = num_trainer_nodes + slurm.num_inference_nodes if slurm.rl_multi_node else 1
    ctx = {"num_trainer_nodes": num_trainer_nodes, **base_context(slurm, template, output_dir, num_nodes)}
    (output_dir / "slurm").mkdir(parents=True, exist_ok=True)
    if slurm.rl_multi_node:
        configs, process_logs, key = _resolve_nodes(rl, slurm, run_dir, dry_run)
        ctx.update(key)
        ctx["health_timeout"] = int(rl.health_timeout)
        ctx["max_log_mb"] = rl.max_log_mb
        if rl.orchestrator.transport.type == "zmq":
            ctx["transport_secret"] = secret_path(run_dir)
        ctx.update(watch_context(rl, run_dir))
    else:
        configs, process_logs = _write_rl_toml(rl, run_dir)
        ctx["rl_config"] = configs["rl"]
    ctx["configs"] = configs
    script = render(template, ctx)
    script_path = output_dir / "slurm" / "rl.sbatch"
    atomic_write_text(script_path, script)
    return SlurmJob(template, script, script_path, ctx["job_log"], process_logs, configs)


def _write_rl_toml(rl: RLConfig, run_dir: RunDir) -> tuple[dict[str, Path], list[Path]]:
    """The user's config with absolute directories (the job may start elsewhere) for the launcher on the node."""
    data = rl.user_input()
    data.pop("slurm", None)
    data["output_dir"] = str(run_dir.root)
    for name in ("trainer", "orchestrator", "inference"):
        if isinstance(data.get(name), dict):
            data[name]["output_dir"] = str(run_dir.root)
    if rl.runs:
        run_dirs = rl.run_dirs()
        data["runs"] = [{**run, "output_dir": str(run_dirs[run["name"]].resolve())} for run in data["runs"]]
    rl_path = run_dir.root / "slurm" / "rl.toml"
    atomic_write_text(rl_path, tomli_w.dumps(_strip_none(data)))
    orchestrators = [orchestrator_name(run.name) for run in rl.runs] or ["orchestrator"]
    servers = [*(["inference"] if rl.inference is not None else []), *(["teacher"] if rl.teacher is not None else [])]
    processes = [*servers, *orchestrators, "trainer"]
    return {"rl": rl_path}, [run_dir.log_file(p) for p in processes]


def _resolve_nodes(
    rl: RLConfig, slurm: SlurmConfig, run_dir: RunDir, dry_run: bool
) -> tuple[dict[str, Path], list[Path], dict[str, Any]]:
    """Each process's config resolved for the job's nodes, written under ``configs/``, and the template's API-key
    variables (:func:`_api_key_by_variable`)."""
    resume = rl.resume or rl.trainer.ckpt.resume_step is not None
    steps = resumable_steps(rl, run_dir.root, verify=True) if resume else ()
    resolved = resolve(rl, ClusterFacts.of_job(slurm, run_dir.root, steps))
    if rl.overwrite and not dry_run:
        clear_run(run_dir)
    processes, key = _api_key_by_variable(resolved.configs, slurm, run_dir)
    configs = {name: write_config(cfg, run_dir.config_file(name)) for name, cfg in processes.items()}
    _mark(run_dir, dry_run)
    logs = [run_dir.logs / f"inference-node{i}.log" for i in range(slurm.num_inference_nodes)]
    return configs, [*logs, run_dir.log_file("orchestrator"), run_dir.log_file("trainer")], key


INFERENCE_KEY_VAR = "PRIME_INFERENCE_API_KEY"


def _api_key_by_variable(
    configs: dict[str, Any], slurm: SlurmConfig, run_dir: RunDir
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's inference servers listen on every interface of their nodes, so they require a key: the user's
    (``inference.server.api_key``, or the variable ``api_key_var`` names in the job's environment), else a fresh one
    the job script writes at every launch into ``<output_dir>/inference.key`` (mode 0600). Every process reads it
    from one environment variable, so no config file in the run directory holds it; before, any host reaching a
    node's port could pause the engine or reset the weights, and a key the user set failed the job's health checks.
    """
    inference = configs.get("inference")
    if slurm.num_inference_nodes == 0 or inference is None:
        return configs, {}
    server = inference.server
    variable = server.api_key_var or INFERENCE_KEY_VAR
    context: dict[str, Any] = {"inference_key_var": variable}
    if server.api_key_var is None:
        context["inference_key"] = run_dir.root / "inference.key"
        context["inference_key_given"] = server.api_key is not None
        if server.api_key is not None:  # a dry run's script too reads it from there
            atomic_write_text(context["inference_key"], server.api_key)  # mkstemp: mode 0600
    out = dict(configs)
    out["inference"] = inference.derive(server=server.derive(api_key=None, api_key_var=variable))
    for name, cfg in configs.items():
        if name == "orchestrator" or name.startswith(orchestrator_name("")):
            out[name] = cfg.derive(client=cfg.client.derive(api_key=None, api_key_var=variable))
    return out, context


def _prepare_sft(config: BaseModel, slurm: SlurmConfig, template: str, dry_run: bool) -> SlurmJob:
    from prime_core.config.trainer import SFTConfig

    sft = SFTConfig.model_validate(config.model_dump(exclude={"slurm", "max_log_mb"}))
    output_dir = Path(sft.output_dir).resolve()
    run_dir = RunDir(output_dir)
    check_output_dir(run_dir, overwrite=sft.overwrite, resume=sft.ckpt.resume_step is not None)
    ctx = base_context(slurm, template, output_dir, slurm.num_nodes)  # what it refuses, it refuses before the clear
    ctx["max_log_mb"] = getattr(config, "max_log_mb", 1024)  # logs/sft.log's bound (`prime-launch log-to`)
    if sft.overwrite and not dry_run:
        clear_run(run_dir)
    # Cleared here, once: the job's own sft (started again if SLURM requeues it) must not clear what it trained.
    device = "cuda" if slurm.gpus_per_node > 0 else "cpu"
    sft = sft.derive(output_dir=output_dir, device=device, overwrite=False)
    configs = {"sft": write_config(sft, run_dir.config_file("sft"))}
    _mark(run_dir, dry_run)
    ctx["configs"] = configs
    script = render(template, ctx)
    slurm_dir = output_dir / "slurm"
    script_path = slurm_dir / "sft.sbatch"
    atomic_write_text(script_path, script)
    return SlurmJob(template, script, script_path, ctx["job_log"], [run_dir.log_file("sft")], configs)
