"""Multi-tenant LoRA with the real `rl` on CPU: two runs of the reverse-text example share one trainer process and
one inference server (torch engine), each with its own orchestrator, adapter and run directory."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.e2e.test_reverse_text import ROOT, rl_cmd, without_evals

# `rl` runs: not in the `multiprocess` xdist group (see tests/e2e/test_reverse_text.py).
pytestmark = pytest.mark.integration

RUNS = [{"name": "run-a"}, {"name": "run-b", "lr": 5e-4, "seed": 7}]


def run_metrics(path: Path, process: str) -> dict[int, dict]:
    found = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["process"] == process:
            found[record["step"]] = record["values"]
    return found


def test_two_lora_runs_share_one_trainer_and_server(tmp_path):
    out = tmp_path / "deployment"
    cmd = rl_cmd(
        out, "--max-steps", "2", "--orchestrator.batch-size", "16", "--model.lora.rank", "8",
        config=without_evals(tmp_path),
    )  # fmt: skip
    result = subprocess.run([*cmd, "--runs", json.dumps(RUNS)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    adapters = {}
    for run in RUNS:
        name = run["name"]
        run_dir = out / "runs" / name
        final = run_dir / "weights" / "step_2"
        assert (final / "STABLE").is_file()
        info = json.loads((final / "prime_adapter.json").read_text())
        assert info["name"] == name and info["step"] == 2
        adapters[name] = load_file(final / "adapter_model.safetensors")
        trainer = run_metrics(run_dir / "metrics.jsonl", "trainer")
        rewards = run_metrics(run_dir / "metrics.jsonl", "orchestrator")
        assert sorted(trainer) == [0, 1] and sorted(rewards) == [0, 1]
        kl = max(values["mismatch_kl/mean"] for values in trainer.values())
        print(f"{name}: max mismatch KL {kl:.2e}, rewards {[rewards[s]['reward/mean'] for s in (0, 1)]}")
        # Each orchestrator samples with its own adapter: the server reproduces the trainer's log-probs.
        assert kl < 1e-5
        assert trainer[0]["lr"] == pytest.approx(run.get("lr", 1e-4))  # the example's constant lr
        assert (out / "logs" / f"orchestrator-{name}.log").stat().st_size > 0
        assert f"summary of run {name}:" in result.stdout

    # Different data and learning rates: the two adapters trained apart from each other.
    a, b = adapters["run-a"], adapters["run-b"]
    assert a.keys() == b.keys()
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b and any(abs(a[k]).max() > 0 for k in lora_b)
    assert any(not (a[k] == b[k]).all() for k in lora_b)
    # The trainer's own directory holds its throughput records and no weights.
    assert run_metrics(out / "metrics.jsonl", "trainer").keys() == {0, 1}
    assert not (out / "weights").exists()
