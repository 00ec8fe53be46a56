"""Golden files of resolved runs: every example config (``examples/*/rl.toml`` and ``rl_gpu.toml``) resolved by
``prime_launch.resolver.resolve`` for a CPU host, one GPU and two GPUs (host facts given here), and through
``prime-launch slurm`` for a one-node SLURM job and a two-node one. Any change to how a run is resolved (a
process's config, its command, devices, environment, the launcher's notes, the SLURM script) shows up as a diff of
``tests/launch/goldens/``.

Regenerate after a deliberate change and review the diff:

    PRIME_UPDATE_GOLDENS=1 uv run pytest tests/launch/test_golden_runs.py -n 0 -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prime_core.config import config_to_toml, load_config
from prime_core.config.rl import RLConfig
from prime_launch import slurm_jobs
from prime_launch.colocate import config_params
from prime_launch.entrypoints.cli import slurm_config_model
from prime_launch.host import HostFacts, ModelFacts, wants_gpus
from prime_launch.resolver import resolve

from tests.launch.launch_fakes import HERE

ROOT = HERE.parents[1]
GOLDENS = HERE / "goldens"
UPDATE = os.environ.get("PRIME_UPDATE_GOLDENS") == "1"
EXAMPLES = sorted(p.relative_to(ROOT) for p in ROOT.glob("examples/*/rl*.toml"))
CASES = ("cpu", "gpu1", "gpu2", "slurm1", "slurm2")
GPU_MIB = 81559  # an H100 80GB as nvidia-smi reports it
CORES = {"cpu": 4, "gpu1": 16, "gpu2": 16}
RUN_ID = "golden"
# Shapes of the hub models the GPU examples name (the colocated fit check sizes them from config.json).
QWEN3_06B = {
    "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
    "tie_word_embeddings": True,
}  # fmt: skip
QWEN3_VL_2B = {
    "model_type": "qwen3_vl",
    "tie_word_embeddings": True,
    "text_config": {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144},
    "vision_config": {"hidden_size": 1024, "depth": 24, "intermediate_size": 4096},
}
HUB_MODELS = {"Qwen/Qwen3-0.6B": QWEN3_06B, "Qwen/Qwen3-VL-2B-Instruct": QWEN3_VL_2B}


@pytest.fixture
def host(tmp_path: Path, monkeypatch) -> Path:
    """The working directory: SLURM jobs resolve the output directory against it and write there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def host_facts(rl: RLConfig, case: str) -> HostFacts:
    """An 80 GB GPU per id of the case, the cores, the executables in /venv/bin, and the model's size (from the
    config.json of the hub models the GPU examples name; a CPU run never sizes its model)."""
    gpus = {"cpu": (), "gpu1": (0,), "gpu2": (0, 1)}[case]
    config = HUB_MODELS.get(rl.trainer.model.name)
    model = ModelFacts(config_params(config), config) if config and gpus and wants_gpus(rl) else ModelFacts()
    return HostFacts(
        gpus=gpus,
        gpu_memory={gpu: GPU_MIB * 1024**2 for gpu in gpus},
        cores=CORES[case],
        executables={name: f"/venv/bin/{name}" for name in ("inference", "orchestrator", "trainer", "torchrun")},
        run_id=RUN_ID,
        model=model,
    )


def _local(config: Path, case: str) -> str:
    rl = load_config(RLConfig, ["@", str(ROOT / config)])
    plan = resolve(rl, host_facts(rl, case))
    lines = ["== devices", *(f"{name}: {text}" for name, text in plan.devices.items())]
    lines += ["== notes", *plan.notes, "== health", *plan.health_urls, f"== api key: {plan.api_key}"]
    lines.append(f"== resume step: {plan.resume_step}")
    for spec in plan.specs:
        lines += [f"== process {spec.name} (log {spec.log_file})", "cmd: " + " ".join(spec.cmd)]
        lines += [f"env: {k}={v}" for k, v in sorted(spec.env.items())]
    for name, cfg in plan.configs.items():
        lines += [f"== {plan.run_dir.config_file(name)}", config_to_toml(cfg).rstrip()]
    return "\n".join(lines)


SLURM_ARGS = {
    "slurm1": [],
    "slurm2": ["--slurm.num-inference-nodes", "1", "--slurm.num-trainer-nodes", "1", "--slurm.gpus-per-node", "8"],
}


def _slurm(config: Path, case: str) -> str:
    cfg = load_config(slurm_config_model("rl"), ["@", str(ROOT / config), *SLURM_ARGS[case]])
    job = slurm_jobs.prepare("rl", cfg, dry_run=True)
    lines = [f"== template {job.template}", "== logs", *map(str, job.process_logs), "== script", job.script.rstrip()]
    for name, path in job.configs.items():
        lines += [f"== {path} ({name})", path.read_text().rstrip()]
    return "\n".join(lines)


def render(config: Path, case: str, host: Path) -> str:
    try:
        text = _slurm(config, case) if case.startswith("slurm") else _local(config, case)
    except (ValueError, FileExistsError) as e:
        text = f"== error\n{type(e).__name__}: {e}"
    return text.replace(str(host), "<host>") + "\n"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", EXAMPLES, ids=str)
def test_resolved_run_matches_its_golden_file(config: Path, case: str, host: Path):
    golden = GOLDENS / config.parent.name / f"{config.stem}.{case}.txt"
    text = render(config, case, host)
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} is missing: regenerate with PRIME_UPDATE_GOLDENS=1 (see this module's doc)"
    assert text == golden.read_text(), (
        f"{config} resolves differently on {case} than {golden} says; if the change is meant, regenerate the goldens "
        "with PRIME_UPDATE_GOLDENS=1 and review the diff"
    )


def test_every_example_config_has_goldens():
    names = {f"{c.parent.name}/{c.stem}.{case}.txt" for c in EXAMPLES for case in CASES}
    found = {str(p.relative_to(GOLDENS)) for p in GOLDENS.rglob("*.txt")}
    assert found == names, f"stale or missing goldens: {sorted(found ^ names)}"
