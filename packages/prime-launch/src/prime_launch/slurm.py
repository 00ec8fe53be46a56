"""Render sbatch scripts from the Jinja2 templates in ``prime_launch/templates`` and submit them."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from prime_core.config.slurm import SlurmConfig

TEMPLATES = {
    "single-node-rl": "single_node_rl.sbatch.j2",
    "multi-node-rl": "multi_node_rl.sbatch.j2",
    "multi-node-sft": "multi_node_sft.sbatch.j2",
}


@dataclass
class SlurmJob:
    """A rendered job: the script, where it goes, and the files it will write."""

    template: str
    script: str
    script_path: Path
    job_log: Path
    process_logs: list[Path] = field(default_factory=list)
    configs: dict[str, Path] = field(default_factory=dict)


def choose_template(kind: str, slurm: SlurmConfig) -> str:
    if slurm.template_path is not None:
        return str(slurm.template_path)
    if slurm.template != "auto":
        if kind == "sft" and slurm.template != "multi-node-sft":
            raise ValueError(f"template {slurm.template!r} does not run an SFT job; use multi-node-sft")
        if kind == "rl" and slurm.template == "multi-node-sft":
            raise ValueError("template 'multi-node-sft' does not run an RL job")
        return slurm.template
    if kind == "sft":
        return "multi-node-sft"
    return "multi-node-rl" if slurm.rl_multi_node else "single-node-rl"


def _environment(search_dir: Path | None = None) -> jinja2.Environment:
    loaders: list[jinja2.BaseLoader] = [jinja2.PackageLoader("prime_launch", "templates")]
    if search_dir is not None:
        loaders.insert(0, jinja2.FileSystemLoader(str(search_dir)))
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env


def render(template: str, context: dict[str, Any]) -> str:
    """Render a built-in template name (``single-node-rl`` ...) or the path of a custom template."""
    if template in TEMPLATES:
        return _environment().get_template(TEMPLATES[template]).render(**context)
    path = Path(template).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"template {template!r} not found")
    return _environment(path.parent).get_template(path.name).render(**context)


def container_args(slurm: SlurmConfig) -> str:
    if not slurm.container_image:
        return ""
    args = f"--container-image={shlex.quote(slurm.container_image)} "
    if slurm.container_mounts:
        args += f"--container-mounts={shlex.quote(','.join(slurm.container_mounts))} "
    return args


def base_context(slurm: SlurmConfig, template: str, output_dir: Path, num_nodes: int) -> dict[str, Any]:
    output_dir = output_dir.resolve()
    if any(c.isspace() for c in str(output_dir)):  # sbatch ends ``#SBATCH --output=<dir>/...`` at the space
        raise ValueError(f"output-dir: {str(output_dir)!r} holds a space, which the job's #SBATCH --output line "
                         "cannot carry: choose a directory without spaces")  # fmt: skip
    project_dir = (slurm.project_dir or Path.cwd()).resolve()
    launcher = (slurm.launcher or "").strip()
    procs_per_node = slurm.gpus_per_node if slurm.gpus_per_node > 0 else slurm.cpu_procs_per_node
    return {
        "slurm": slurm,
        "template_name": template,
        "num_nodes": num_nodes,
        "output_dir": output_dir,
        "project_dir": project_dir,
        "job_log": output_dir / "slurm" / "job_%j.log",
        "launcher": f"{launcher} " if launcher else "",
        "container_args": container_args(slurm),
        "procs_per_node": procs_per_node,
        "inference_args": "",
        "health_timeout": 1800,
    }


def submit(script_path: Path) -> str:
    """``sbatch`` the script; return the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError("sbatch not found on PATH: run on a SLURM login node, or use --dry-run to only render")
    result = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"sbatch failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )
    match = re.match(r"\s*(\d+)", result.stdout)
    if not match:
        raise RuntimeError(f"sbatch printed no job id: {result.stdout.strip()!r}")
    return match.group(1)
