"""Facts about the machine a run starts on, gathered once: every read of the host the resolver needs (GPUs and their
memory, cores, executables, the model's size, checkpoints to resume from) happens here, so that
``prime_launch.resolver.resolve`` is a pure function of the user's config and these facts.

Nothing here imports torch: the launcher must not create a CUDA context on the GPU it hands to vLLM. The model's size
comes from its safetensors headers (exact) or, for a random init or changed architecture, from its config.json.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_core.config.rl import RLConfig
from prime_core.config.slurm import SlurmConfig
from prime_core.config.trainer import TrainerConfig
from prime_core.io import read_json
from prime_core.preflight import hf_cache_dir
from prime_core.run_dir import RunDir

from prime_launch.colocate import config_params
from prime_launch.cpu_threads import available_cores

BIN_DIR_ENV = "PRIME_LAUNCH_BIN_DIR"
"""Directory searched first for the ``trainer``/``orchestrator``/``inference``/``torchrun`` executables."""
EXECUTABLES = ("inference", "orchestrator", "trainer", "torchrun")


@dataclass(frozen=True)
class ModelFacts:
    """The size of the model the trainer builds, for the colocated fit check (None: not found on this host)."""

    num_params: int | None = None
    config: Mapping[str, Any] | None = None
    """Its HF ``config.json`` with the trainer's ``init.config_overrides`` applied."""


@dataclass(frozen=True)
class HostFacts:
    """One machine that runs every process of a run (``rl``, or the node of a one-node SLURM job)."""

    gpus: tuple[int, ...] = ()
    """GPU ids visible to the launcher (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``)."""
    gpu_memory: Mapping[int, int] = field(default_factory=dict)
    """Total memory in bytes by ``nvidia-smi`` index (empty: unknown)."""
    cores: int = 1
    """Cores the launcher may run on (its affinity mask)."""
    environ: Mapping[str, str] = field(default_factory=dict)
    """The launcher's environment, which every process inherits (``OMP_NUM_THREADS``, API key variables)."""
    executables: Mapping[str, str] = field(default_factory=dict)
    """Path of each entry point found (``inference``, ``orchestrator``, ``trainer``, ``torchrun``)."""
    checkpoint_steps: tuple[int, ...] = ()
    """Steps under ``<output_dir>/checkpoints`` with a STABLE marker, ascending (gathered for ``--resume``)."""
    run_id: str = "run"
    """This launch's id: the orchestrator waits for the inference server reporting it."""
    model: ModelFacts = field(default_factory=ModelFacts)


@dataclass(frozen=True)
class ClusterFacts:
    """A multi-node SLURM job: inference nodes then trainer nodes, each process started by the job script."""

    output_dir: Path
    """The run directory, absolute (every node sees it on shared storage)."""
    num_inference_nodes: int
    num_trainer_nodes: int
    gpus_per_node: int
    """0: CPU nodes."""
    procs_per_node: int
    """Trainer ranks per node (its GPUs, or ``cpu_procs_per_node`` on CPU nodes)."""
    inference_port: int
    checkpoint_steps: tuple[int, ...] = ()

    @classmethod
    def of_job(cls, slurm: SlurmConfig, output_dir: Path, checkpoint_steps: tuple[int, ...] = ()) -> ClusterFacts:
        return cls(
            output_dir=output_dir,
            num_inference_nodes=slurm.num_inference_nodes,
            num_trainer_nodes=slurm.rl_num_trainer_nodes,
            gpus_per_node=slurm.gpus_per_node,
            procs_per_node=slurm.gpus_per_node if slurm.gpus_per_node > 0 else slurm.cpu_procs_per_node,
            inference_port=slurm.inference_port,
            checkpoint_steps=checkpoint_steps,
        )


def wants_gpus(rl: RLConfig) -> bool:
    """Whether the run looks for GPUs: ``devices.type``, except that a trainer pinned to the CPU beside the torch
    engine (or no inference server) is a CPU run (the examples' rl.toml) on a GPU host too."""
    inference = rl.inference
    cpu_run = rl.trainer.device == "cpu" and (inference is None or inference.engine == "torch")
    return rl.devices.type == "cuda" or (rl.devices.type == "auto" and not cpu_run)


def gather_host_facts(
    rl: RLConfig, environ: Mapping[str, str] | None = None, *, run_id: str | None = None, cores: int | None = None
) -> HostFacts:
    """Read what resolving ``rl`` on this machine needs. ``environ`` defaults to the launcher's environment, ``cores``
    to its affinity mask; the run id to ``PRIME_RUN_ID``, else a fresh one."""
    environ = dict(os.environ if environ is None else environ)
    gpus = tuple(visible_gpus(environ)) if wants_gpus(rl) and rl.devices.gpu_ids is None else ()
    # Inference and trainer may share a GPU: the fit check needs its memory and the model's size.
    shared_possible = wants_gpus(rl) and bool(gpus or rl.devices.gpu_ids) and rl.inference is not None
    memory = gpu_memory(environ) if shared_possible and rl.devices.gpu_memory_gib is None else {}
    model = (
        ModelFacts(count_params(rl.trainer, environ), model_config(rl.trainer, environ)) if shared_possible else None
    )
    resume = rl.resume or rl.trainer.ckpt.resume_step is not None
    return HostFacts(
        gpus=gpus,
        gpu_memory=memory,
        cores=available_cores() if cores is None else cores,
        environ=environ,
        executables=find_executables(environ),
        checkpoint_steps=resumable_steps(rl, verify=True) if resume else (),
        run_id=run_id or environ.get("PRIME_RUN_ID") or uuid.uuid4().hex[:12],
        model=model or ModelFacts(),
    )


def resumable_steps(rl: RLConfig, output_dir: Path | None = None, *, verify: bool = False) -> tuple[int, ...]:
    """Checkpoint steps the run can resume from: complete on every side, weights included (``RunDir.resumable_steps``).
    ``verify``: ValueError when the weights of the step the run resumes from (``ckpt.resume_step``, else the newest, as
    ``--resume`` takes) are not what the trainer wrote (it reads them: once per launch, where the step is chosen)."""
    from prime_launch.resume import check_resume_weights

    runs = [RunDir(path) for path in rl.run_dirs().values()]
    run_dir = RunDir(output_dir or rl.run_dir)
    steps = tuple(run_dir.resumable_steps(runs))
    if verify:
        check_resume_weights(steps, runs or [run_dir], run_dir.root, rl.trainer.ckpt.resume_step)
    return steps


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


def find_executables(environ: Mapping[str, str]) -> dict[str, str]:
    """The entry points found; a missing one is an error only where the resolver needs it."""
    found = {}
    for name in EXECUTABLES:
        with suppress(FileNotFoundError):
            found[name] = find_executable(name, environ)
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


def gpu_memory(environ: Mapping[str, str]) -> dict[int, int]:
    """Total memory in bytes of every GPU by ``nvidia-smi`` index (``--query-gpu=memory.total``); {} without it."""
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return {}
    cmd = [smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    mib: dict[int, int] = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            mib[int(parts[0])] = int(parts[1]) * 1024**2
    return mib


def model_dir(name: str, environ: Mapping[str, str]) -> Path | None:
    """The local directory of a model: the path itself, else its HF cache snapshot (``refs/main`` first)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    repo = hf_cache_dir(dict(environ)) / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    snapshots = sorted((repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
    return snapshots[-1] if snapshots else None


SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
"""safetensors' own bound on a header: a file claiming more is not one (and would be read whole into memory)."""


def safetensors_params(directory: Path) -> int | None:
    """Parameters stored in the directory's safetensors files, from their headers; None without (readable) files.

    A downloaded directory may hold anything under these names: a length field of gigabytes, a FIFO (opening it
    blocks the launcher for ever), a device. Only regular files are opened, and a header is read only up to the
    bound safetensors itself sets."""
    files = sorted(directory.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        return None
    total = 0
    try:
        for file in files:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > SAFETENSORS_MAX_HEADER:
                    return None
                header = json.loads(f.read(size))
            total += sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def model_config(trainer: TrainerConfig, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The HF config of the model the trainer builds (its overrides applied); None when no config.json is here."""
    directory = model_dir(trainer.model.name, environ)
    try:
        # Only a regular file: a FIFO under the name (a downloaded or shared directory) blocked the launcher in open.
        config = read_json(directory / "config.json", "a model config") if directory else None
    except (OSError, ValueError):
        return None
    return {**config, **trainer.init.config_overrides} if isinstance(config, dict) else None


def count_params(trainer: TrainerConfig, environ: Mapping[str, str]) -> int | None:
    """Parameters of the model the trainer builds; None when neither its weights nor its config.json are here."""
    directory = model_dir(trainer.model.name, environ)
    if directory is None:
        return None
    if not trainer.init.random and not trainer.init.config_overrides:
        found = safetensors_params(directory)
        if found is not None:
            return found
    config = model_config(trainer, environ)
    try:
        return config_params(config) if config is not None else None
    except (KeyError, TypeError):
        return None
