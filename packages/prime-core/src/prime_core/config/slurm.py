"""SLURM job settings used by ``prime-launch slurm`` to render and submit sbatch scripts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import BaseConfig, control_character_error


class SlurmConfig(BaseConfig):
    """One SLURM job: resources, the environment set-up lines, and which template renders it."""

    template: Literal["auto", "single-node-rl", "multi-node-rl", "multi-node-sft"] = "auto"
    """Template: auto picks single-node-rl for an RL job on one node, multi-node-rl for more, and
    multi-node-sft for SFT (which also serves one node)."""
    template_path: Path | None = None
    """A custom Jinja2 sbatch template; it receives the same variables as the built-in ones."""
    job_name: str = "prime"
    """``#SBATCH --job-name``."""
    partition: str | None = None
    """``#SBATCH --partition``; the cluster default when unset."""
    account: str | None = None
    """``#SBATCH --account``; the user's default when unset."""
    qos: str | None = None
    """``#SBATCH --qos``."""
    time: str = "24:00:00"
    """``#SBATCH --time`` limit, e.g. ``2-00:00:00`` or ``30:00``."""
    num_nodes: int = Field(default=1, ge=1)
    """Nodes of the job. SFT: all run the trainer under torchrun. RL: 1 runs the ``rl`` launcher on one node;
    more (or setting ``num_inference_nodes`` / ``num_trainer_nodes``) splits the nodes into inference nodes
    and trainer nodes (multi-node-rl)."""
    num_inference_nodes: int = Field(default=1, ge=0)
    """RL multi-node: nodes that run an inference server (the first nodes of the allocation). 0 with
    ``inference_url`` uses a server outside the job."""
    num_trainer_nodes: int | None = Field(default=None, ge=1)
    """RL multi-node: nodes that run the trainer under torchrun (after the inference nodes); the orchestrator
    runs on the first of them, beside trainer rank 0. Default: ``num_nodes - num_inference_nodes`` (at least 1)."""
    inference_url: str | None = None
    """RL with ``num_inference_nodes = 0``: base URL of an inference server started elsewhere."""
    gpus_per_node: int = Field(default=8, ge=0)
    """GPUs requested on every node (``--gres=gpu:N``); 0 runs on CPUs (trainer ranks = ``cpu_procs_per_node``)."""
    cpu_procs_per_node: int = Field(default=1, ge=1)
    """Trainer ranks per node when ``gpus_per_node = 0`` (torchrun over gloo)."""
    cpus_per_task: int | None = Field(default=None, ge=1)
    """``#SBATCH --cpus-per-task``."""
    mem: str | None = None
    """``#SBATCH --mem``, e.g. ``0`` for all of a node's memory or ``64G``."""
    exclusive: bool = True
    """``#SBATCH --exclusive``: whole nodes."""
    nodelist: str | None = None
    """``#SBATCH --nodelist``."""
    exclude: str | None = None
    """``#SBATCH --exclude``."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """More ``#SBATCH`` options, each like ``--reservation=abc`` (without the ``#SBATCH`` prefix)."""
    project_dir: Path | None = None
    """Checkout the job runs in (``cd`` first); the submitting directory when unset."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run on every node before the processes start: ``module load ...``, ``source .env``,
    ``source .venv/bin/activate``, exports."""
    container_image: str | None = None
    """Run each node's processes in this container (pyxis ``srun --container-image``)."""
    container_mounts: list[str] = Field(default_factory=list)
    """pyxis ``--container-mounts`` entries, like ``/data:/data``; the output directory must be shared."""
    launcher: str | None = "uv run"
    """Prefix of every prime command inside the job; ``none`` when ``setup`` activates the environment."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """torchrun rendezvous port on the first trainer node."""
    inference_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the inference server on every inference node."""

    @field_validator(
        "job_name", "partition", "account", "qos", "time", "mem", "nodelist", "exclude", "extra_sbatch",
        "container_image", "container_mounts", "launcher", "inference_url",
    )  # fmt: skip
    @classmethod
    def _one_line(cls, value: str | list[str] | None) -> str | list[str] | None:
        # Each is written into one line of the sbatch script (``#SBATCH --job-name=...``): after a newline the rest
        # would run as a command of its own. ``setup`` is shell lines by design.
        for text in [value] if isinstance(value, str) else value or []:
            if why := control_character_error(text):
                raise ValueError(why)
        return value

    @field_validator("job_name", "partition", "account", "qos", "time", "mem", "nodelist", "exclude")
    @classmethod
    def _one_word(cls, value: str | None) -> str | None:
        # sbatch ends an #SBATCH value at a space: ``--job-name=my run`` would name the job ``my``.
        if value is not None and (not value.strip() or any(c.isspace() for c in value)):
            raise ValueError("an #SBATCH value is one word: no spaces, not empty")
        return value

    @property
    def rl_multi_node(self) -> bool:
        """Whether an RL job spans several nodes (multi-node-rl) rather than running ``rl`` on one."""
        if self.template != "auto" or self.template_path is not None:
            return self.template == "multi-node-rl"
        return self.num_nodes > 1 or bool({"num_inference_nodes", "num_trainer_nodes"} & self.model_fields_set)

    @property
    def rl_num_trainer_nodes(self) -> int:
        if self.num_trainer_nodes is not None:
            return self.num_trainer_nodes
        return max(1, self.num_nodes - self.num_inference_nodes)

    @model_validator(mode="after")
    def _check(self) -> SlurmConfig:
        if self.num_inference_nodes == 0 and not self.inference_url and self.rl_multi_node:
            raise ValueError("num_inference_nodes = 0 needs inference_url (a server started outside the job)")
        if self.template_path is not None and self.template != "auto":
            raise ValueError("set either template or template_path, not both")
        return self
