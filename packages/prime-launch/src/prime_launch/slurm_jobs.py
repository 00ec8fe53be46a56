"""Prepare SLURM jobs: resolve the configs a job needs, write them to the shared output dir, render the script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w
from prime_core.config import write_config
from prime_core.config.slurm import SlurmConfig
from prime_core.io import atomic_write_text
from prime_core.run_dir import RunDir
from pydantic import BaseModel

from prime_launch.plan import DRY_RUN_MARKER, _update, check_output_dir, clear_run, orchestrator_name
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
        return _prepare_rl(config, slurm, template, dry_run)
    return _prepare_sft(config, slurm, template, dry_run)


def _prepare_rl(config: BaseModel, slurm: SlurmConfig, template: str, dry_run: bool) -> SlurmJob:
    from prime_core.config.rl import RLConfig

    rl = RLConfig.model_validate(config.model_dump(exclude={"slurm"}, exclude_unset=True))
    output_dir = rl.run_dir.resolve()
    run_dir = RunDir(output_dir)
    check_output_dir(run_dir, overwrite=rl.overwrite, resume=rl.resume)
    ctx: dict = {}
    single = not slurm.rl_multi_node
    num_trainer_nodes = slurm.rl_num_trainer_nodes
    num_nodes = 1 if single else slurm.num_inference_nodes + num_trainer_nodes
    ctx["num_trainer_nodes"] = num_trainer_nodes
    ctx.update(base_context(slurm, template, output_dir, num_nodes))
    slurm_dir = output_dir / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    orchestrators = [orchestrator_name(run.name) for run in rl.runs] or ["orchestrator"]
    process_logs = [run_dir.log_file(p) for p in ("inference", *orchestrators, "trainer")]
    configs: dict[str, Path] = {}
    if single:
        # The local launcher runs inside the allocation and does the device split itself.
        data = rl.model_dump(mode="json", exclude_unset=True)
        data["output_dir"] = str(output_dir)
        for name in ("trainer", "orchestrator", "inference"):
            if isinstance(data.get(name), dict):
                data[name]["output_dir"] = str(output_dir)
        if rl.runs:
            data["runs"] = [
                {**run.model_dump(mode="json", exclude_unset=True), "output_dir": str(Path(run.output_dir).resolve())}
                for run in rl.runs
            ]
        rl_path = slurm_dir / "rl.toml"
        atomic_write_text(rl_path, tomli_w.dumps(_strip_none(data)))
        configs["rl"] = rl_path
        ctx["rl_config"] = rl_path
        if rl.inference is None:
            process_logs = process_logs[1:]
    else:
        if rl.runs:
            raise ValueError("runs (multi-tenant LoRA) launch on one node: use the single-node-rl template")
        if rl.overwrite and not dry_run:
            clear_run(run_dir)
        trainer, orchestrator, inference = rl.trainer, rl.orchestrator, rl.inference
        procs = ctx["procs_per_node"]
        trainer = _update(trainer, "output_dir", output_dir)
        trainer = _update(trainer, "device", "cuda" if slurm.gpus_per_node > 0 else "cpu")
        orchestrator = _update(orchestrator, "output_dir", output_dir)
        orchestrator = _update(orchestrator, "num_trainer_ranks", num_trainer_nodes * procs)
        if rl.resume and trainer.ckpt.resume_step is None:
            steps = run_dir.resumable_steps()
            if not steps:
                raise ValueError(f"--resume: no checkpoint under {run_dir.checkpoints} to resume from")
            trainer = _update(trainer, "ckpt.resume_step", steps[-1])
            orchestrator = _update(orchestrator, "ckpt.resume_step", steps[-1])
        configs["trainer"] = write_config(trainer, run_dir.config_file("trainer"))
        configs["orchestrator"] = write_config(orchestrator, run_dir.config_file("orchestrator"))
        if slurm.num_inference_nodes > 0:
            if inference is None:
                raise ValueError(
                    "num_inference_nodes > 0 needs an [inference] config (or set it to 0 with inference_url)"
                )
            inference = _update(inference, "output_dir", output_dir)
            roots = list(inference.server.weight_roots) or [run_dir.weights]
            data = inference.model_dump(mode="python")
            data["server"].update(host="0.0.0.0", port=slurm.inference_port, weight_roots=roots)
            if slurm.gpus_per_node > 0:
                data["engine"] = "vllm" if data["engine"] == "auto" else data["engine"]
                tp = inference.vllm.tensor_parallel_size
                if slurm.gpus_per_node % tp:
                    raise ValueError(
                        f"gpus_per_node ({slurm.gpus_per_node}) is not a multiple of tensor_parallel_size ({tp})"
                    )
                data["vllm"]["data_parallel_size"] = slurm.gpus_per_node // tp
            else:
                data["engine"] = "torch"
            inference = type(inference).model_validate(data)
            configs["inference"] = write_config(inference, run_dir.config_file("inference"))
            process_logs = [run_dir.logs / f"inference-node{i}.log" for i in range(slurm.num_inference_nodes)]
            process_logs += [run_dir.log_file("orchestrator"), run_dir.log_file("trainer")]
        else:
            process_logs = [run_dir.log_file("orchestrator"), run_dir.log_file("trainer")]
        _mark(run_dir, dry_run)
        ctx["health_timeout"] = int(rl.health_timeout)
        ctx.update(watch_context(rl.liveness, trainer.ckpt.resume_step))
    ctx["configs"] = configs
    script = render(template, ctx)
    script_path = slurm_dir / "rl.sbatch"
    atomic_write_text(script_path, script)
    return SlurmJob(template, script, script_path, ctx["job_log"], process_logs, configs)


def _prepare_sft(config: BaseModel, slurm: SlurmConfig, template: str, dry_run: bool) -> SlurmJob:
    from prime_core.config.trainer import SFTConfig

    sft = SFTConfig.model_validate(config.model_dump(exclude={"slurm", "overwrite"}))
    output_dir = Path(sft.output_dir).resolve()
    run_dir = RunDir(output_dir)
    overwrite = bool(getattr(config, "overwrite", False))
    check_output_dir(run_dir, overwrite=overwrite, resume=sft.ckpt.resume_step is not None)
    if overwrite and not dry_run:
        clear_run(run_dir)
    sft = _update(sft, "output_dir", output_dir)
    sft = _update(sft, "device", "cuda" if slurm.gpus_per_node > 0 else "cpu")
    ctx = base_context(slurm, template, output_dir, slurm.num_nodes)
    configs = {"sft": write_config(sft, run_dir.config_file("sft"))}
    _mark(run_dir, dry_run)
    ctx["configs"] = configs
    script = render(template, ctx)
    slurm_dir = output_dir / "slurm"
    script_path = slurm_dir / "sft.sbatch"
    atomic_write_text(script_path, script)
    return SlurmJob(template, script, script_path, ctx["job_log"], [run_dir.log_file("sft")], configs)
