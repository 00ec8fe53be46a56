"""Every example under examples/ keeps working: each CPU ``rl.toml`` runs 2 steps (of two groups) with the real ``rl`` (torch-engine
inference, orchestrator, trainer) without its evals, and each ``rl_gpu.toml`` resolves and validates under
``rl --dry-run`` on two GPUs and on one (colocated), with ``CUDA_VISIBLE_DEVICES`` standing in for the GPUs.

Whether reverse-text learns is tested in tests/e2e/test_reverse_text.py; the arithmetic, tool-use and guess-number
README runs are here, under ``slow`` (about 9 minutes each on 2 cores). The rest are smoke checks that keep the folders
from rotting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RL = Path(sys.executable).with_name("rl")
CPU_EXAMPLES = sorted(p.parent.name for p in EXAMPLES.glob("*/rl.toml"))
GPU_EXAMPLES = sorted(p.parent.name for p in EXAMPLES.glob("*/rl_gpu.toml"))
# The README runs of tool_use, arithmetic and guess_number are slow tests below; reverse_text's rl.toml runs in full
# in tests/e2e/test_reverse_text.py: its smoke run would repeat it in CI; distill_reverse_text's 2 steps (four
# processes) run with their own checks in tests/e2e/test_distill_example.py.
SLOW_CPU_EXAMPLES = {"tool_use", "reverse_text", "distill_reverse_text"}


def metrics(out: Path) -> dict[str, dict[int, dict]]:
    found: dict[str, dict[int, dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        # A process may log several records at one step (the orchestrator: its step, then an eval).
        found.setdefault(record["process"], {}).setdefault(record["step"], {}).update(record["values"])
    return found


def test_every_example_has_a_readme_a_cpu_and_a_gpu_config():
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert folders, "no examples"
    for name in folders:
        for file in ("README.md", "rl.toml", "rl_gpu.toml"):
            assert (EXAMPLES / name / file).is_file(), f"examples/{name}/{file} is missing"
        head = (EXAMPLES / name / "rl_gpu.toml").read_text().split("\n\n")[0]
        assert f"CUDA_VISIBLE_DEVICES=0 uv run rl @ examples/{name}/rl_gpu.toml" in head, (
            f"examples/{name}/rl_gpu.toml does not say how to run on one GPU"
        )


@pytest.mark.integration  # `rl` runs: not in the `multiprocess` xdist group (see tests/e2e/test_reverse_text.py)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CPU_EXAMPLES else n for n in CPU_EXAMPLES]
)
def test_cpu_example_runs_two_steps(tmp_path, name):
    """Two steps of the example's own config (its model, environment, sampling, sequence length and trainer), on
    two groups a step instead of its full batch: what the smoke run checks (every rollout of its environment
    succeeds, the trainer trains on them, inference serves the new weights for step 1) does not depend on the
    batch's size, and the full batches took half of a run's CPU time (2 steps on 2 cores: arithmetic 77 s at 128
    rollouts a step, 39 s at 16; code 122 s at 64, 79 s at 32). The README runs (slow, below) and
    tests/e2e/test_reverse_text.py train at full size."""
    config = EXAMPLES / name / "rl.toml"
    groups = 2 * tomllib.loads(config.read_text())["orchestrator"]["rollouts_per_example"]
    out = tmp_path / "run"
    cmd = [str(RL), "@", str(config), "--output-dir", str(out), "--max-steps", "2"]
    cmd += ["--inference.server.port", str(free_port()), "--console", "quiet", "--orchestrator.eval.envs", "[]"]
    cmd += ["--orchestrator.batch-size", str(groups)]
    if "teacher" in tomllib.loads(config.read_text()):  # its fixed port (8001) may be another run's on this host
        cmd += ["--teacher.port", str(free_port())]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(f"examples/{name}/rl.toml, 2 steps: {time.monotonic() - start:.0f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = metrics(out)
    assert sorted(found["trainer"]) == sorted(found["orchestrator"]) == [0, 1], found.keys()
    for step in found["orchestrator"].values():
        assert step["failed/rollouts"] == 0
        assert not any(key.startswith("eval/") for key in step)
    assert sum(step["loss_tokens"] for step in found["trainer"].values()) > 0, "the trainer saw no samples"
    assert (out / "weights" / "step_2").is_dir()


def readme_run(tmp_path, name: str, env: str) -> tuple[dict, dict, list, dict]:
    """`rl @ examples/<name>/rl.toml` as its README runs it: (eval t=1 by step, greedy eval by step, training rewards,
    trainer metrics by step)."""
    out = tmp_path / "run"
    cmd = [str(RL), "@", str(EXAMPLES / name / "rl.toml"), "--output-dir", str(out)]
    cmd += ["--inference.server.port", str(free_port()), "--console", "quiet"]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = metrics(out)
    orchestrator = found["orchestrator"]
    rewards = [orchestrator[s]["reward/mean"] for s in sorted(orchestrator) if "reward/mean" in orchestrator[s]]
    t1, t0 = ({s: v[key] for s, v in orchestrator.items() if key in v} for key in
              (f"eval/{env}/t1/reward/mean", f"eval/{env}/t0/reward/mean"))  # fmt: skip
    print(
        f"{time.monotonic() - start:.0f} s; eval t=1 {t1}, greedy {t0}; reward first {rewards[:3]} last {rewards[-3:]}"
    )
    return t1, t0, rewards, found["trainer"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(1800)
def test_arithmetic_readme_run_learns(tmp_path):
    """The held-out eval at temperature 1.0 gains at least 0.15, greedy decoding stays within noise (128 problems),
    the training reward (5-step means) rises by at least 0.15."""
    t1, t0, rewards, trainer = readme_run(tmp_path, "arithmetic", "arithmetic")
    assert sorted(t1) == sorted(t0) == [0, 40], (t1, t0)
    assert t1[40] >= t1[0] + 0.15, t1
    assert t0[40] >= t0[0] - 0.03, t0
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.15, rewards  # 16 problems a step: noisy
    assert max(v["mismatch_kl/mean"] for v in trainer.values()) < 1e-3


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(1800)
def test_tool_use_readme_run_learns(tmp_path):
    """The SFT model answers without the tool in about 40% of its samples; after 40 steps the held-out eval at
    temperature 1.0 gains at least 0.15 (measured: 0.54 -> 0.78), greedy decoding (always the tool) stays within
    noise, and the training reward (5-step means, 8 problems a step) rises by at least 0.1."""
    t1, t0, rewards, trainer = readme_run(tmp_path, "tool_use", "tool-use")
    assert sorted(t1) == sorted(t0) == [0, 40], (t1, t0)
    assert t1[40] >= t1[0] + 0.15, t1
    assert t0[40] >= t0[0] - 0.03, t0
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.1, rewards
    assert max(v["mismatch_kl/mean"] for v in trainer.values()) < 1e-3


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(1800)
def test_guess_number_readme_run_learns(tmp_path):
    """The SFT model plays a random game in about 40% of its samples; after 30 steps of whole-game RL the held-out
    eval at temperature 1.0 gains at least 0.06 (measured: 0.39 -> 0.49 on 2 cores), greedy decoding (the binary
    search) stays within noise, and the training reward (5-step means, 8 secrets a step) rises by at least 0.05."""
    t1, t0, rewards, trainer = readme_run(tmp_path, "guess_number", "guess-number")
    assert sorted(t1) == sorted(t0) == [0, 30], (t1, t0)
    assert t1[30] >= t1[0] + 0.06, t1
    assert t0[30] >= t0[0] - 0.03, t0
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.05, rewards
    assert max(v["mismatch_kl/mean"] for v in trainer.values()) < 1e-3


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_resolves_under_dry_run(tmp_path, monkeypatch, name):
    """The config validates and plans: vLLM on GPU 0 and the trainer on GPU 1 with NCCL weights, or both on GPU 0
    (colocated, weights through the GPU's memory) when one GPU is visible. The two-GPU layout is the real `rl
    --dry-run`; the one-GPU layout is resolved in this process without the orchestrator's own check (it checks the
    environments, which the layout does not change, in ~11 s of imports a run on this 2-core host)."""
    config = EXAMPLES / name / "rl_gpu.toml"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    cmd = [str(RL), "@", str(config), "--dry-run", "--output-dir", str(tmp_path / "two")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_layout(tmp_path / "two", result.stdout, gpus="0,1")

    import io

    from prime_core.config import load_config
    from prime_core.config.rl import RLConfig
    from prime_launch import launcher

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(launcher, "check_orchestrators", lambda specs: None)
    rl = load_config(RLConfig, ["@", str(config), "--output-dir", str(tmp_path / "one")])
    out = io.StringIO()
    launcher.dry_run(rl, out=out)
    _assert_layout(tmp_path / "one", out.getvalue(), gpus="0")


def _assert_layout(out: Path, stdout: str, gpus: str) -> None:
    configs = {p: tomllib.loads((out / "configs" / f"{p}.toml").read_text()) for p in ("inference", "trainer")}
    assert configs["inference"]["engine"] == "vllm"
    assert configs["trainer"]["async_level"] == 1
    broadcast = configs["trainer"]["weights"]["broadcast"]["type"]
    assert broadcast == ("nccl" if gpus == "0,1" else "cuda_ipc"), broadcast
    lines = {line.split()[0]: line for line in stdout.splitlines() if line.startswith("  ")}
    if gpus == "0,1":
        assert "(GPU 0)" in lines["inference"] and "(GPU 1)" in lines["trainer"], stdout
    else:
        assert "GPU 0 shared" in lines["inference"] and "GPU 0 shared" in lines["trainer"], stdout
