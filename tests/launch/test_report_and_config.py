"""prime-launch report, RLConfig shared-field filling, device assignment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prime_core.config import ConfigError, load_config
from prime_core.config.rl import RLConfig
from prime_launch.launcher import resolve_here


def test_report_writes_png(tmp_path):
    lines = []
    for step in range(12):
        lines.append({"step": step, "process": "orchestrator", "time": 0, "values": {"reward/mean": step / 12}})
        lines.append({"step": step, "process": "trainer", "time": 0, "values": {"loss/mean": 1 / (step + 1)}})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")
    result = subprocess.run(
        [sys.executable, "-m", "prime_launch.entrypoints.cli", "report", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_metrics_is_an_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "prime_launch.entrypoints.cli", "plot", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no metrics" in result.stderr
    assert "the run has not finished a step" in result.stderr
    missing = tmp_path / "no-such-run"
    result = subprocess.run([sys.executable, "-m", "prime_launch.entrypoints.cli", "report", "--output-dir",
                             str(missing)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == f"error: output-dir: {str(missing)!r} is not a run directory (no such directory)\n"


def test_shared_fields_fill_sub_configs_unless_set():
    cfg = load_config(
        RLConfig,
        [
            "--max-steps",
            "9",
            "--model.name",
            "m",
            "--orchestrator.seed",
            "4",
            "--seed",
            "4",
            "--inference.engine",
            "torch",
        ],
    )
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 9
    assert cfg.trainer.model.name == cfg.orchestrator.model.name == cfg.inference.model.name == "m"
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        load_config(RLConfig, ["--max-steps", "9", "--trainer.max-steps", "3"])


def test_wandb_shared_section_enables_both_sides():
    cfg = load_config(RLConfig, ["--wandb.project", "p", "--wandb.name", "exp"])
    for sub in (cfg.trainer, cfg.orchestrator):
        assert sub.monitor.wandb.enabled and sub.monitor.wandb.project == "p" and sub.monitor.wandb.name == "exp"


def test_devices_inference_first_then_trainer(monkeypatch):
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--devices.num-trainer-gpus", "2"])
    plan = resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "PATH": "/usr/bin"})
    env = {s.name: s.env for s in plan.specs}
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == "4"
    assert env["trainer"]["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert env["orchestrator"]["CUDA_VISIBLE_DEVICES"] == ""
    trainer_cmd = next(s.cmd for s in plan.specs if s.name == "trainer")
    assert "--nproc-per-node" in trainer_cmd and trainer_cmd[trainer_cmd.index("--nproc-per-node") + 1] == "2"
    assert plan.configs["orchestrator"].num_trainer_ranks == 2
    with pytest.raises(ValueError, match="only 4 available"):
        resolve_here(
            load_config(RLConfig, ["--inference.engine", "auto", "--devices.num-trainer-gpus", "4"]),
            {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
        )


def test_cpu_only_uses_torch_engine_and_gloo_ranks():
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--devices.num-cpu-trainer-procs", "2"])
    plan = resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": ""})
    assert plan.configs["inference"].engine == "torch"
    assert plan.configs["trainer"].device == "cpu"
    trainer_cmd = next(s.cmd for s in plan.specs if s.name == "trainer")
    assert trainer_cmd[0].endswith("torchrun") and "--no-python" in trainer_cmd


def test_cpu_trainer_with_torch_engine_stays_on_cpu_beside_gpus():
    cfg = load_config(RLConfig, ["--trainer.device", "cpu", "--inference.engine", "torch"])
    plan = resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": "0"})
    assert plan.devices["trainer"].startswith("CPU") and plan.devices["inference"].startswith("CPU (torch engine)")
    assert all(s.env.get("CUDA_VISIBLE_DEVICES") == "" for s in plan.specs if s.name in ("trainer", "inference"))


def test_without_inference_uses_external_server():
    cfg = load_config(RLConfig, ["--orchestrator.client.base-urls", "http://10.0.0.5:8000"])
    plan = resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": ""})
    assert [s.name for s in plan.specs] == ["orchestrator", "trainer"]
    assert plan.health_urls == ["http://10.0.0.5:8000/health"]


def test_base_url_must_match_the_started_server():
    cfg = load_config(
        RLConfig, ["--inference.server.port", "8001", "--orchestrator.client.base-urls", "http://127.0.0.1:8000"]
    )
    with pytest.raises(ValueError, match="port 8001"):
        resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": ""})


def test_torchrun_of_a_multi_rank_trainer_leaves_nothing_in_tmp(tmp_path):
    """torchrun keeps its ranks' logs under a fresh /tmp/torchelastic_* unless told otherwise, and never removes it:
    one more directory in /tmp per launch of every run, resumed or not."""
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--devices.num-cpu-trainer-procs", "2"])
    trainer_cmd = next(s.cmd for s in resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": ""}).specs if s.name == "trainer")
    launcher = trainer_cmd[: trainer_cmd.index("--no-python") + 1]
    launcher[0] = str(Path(sys.executable).with_name("torchrun"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, "true"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp.iterdir()) == []


def test_after_the_trainer_rl_waits_for_an_evaluation_only_where_one_is_configured(tmp_path):
    """rl said "waiting for the final evaluation" when the trainer finished first, also for a run without eval."""
    from prime_launch.launcher import _after_trainer

    base = ["@", str(Path(__file__).parent / "rl_example.toml"), "--output-dir", str(tmp_path)]
    no_eval = resolve_here(load_config(RLConfig, base), {"PATH": "/usr/bin"})
    assert _after_trainer(no_eval) == "the orchestrator to finish"
    with_eval = load_config(RLConfig, [*base, "--orchestrator.eval.envs", '[{"id": "reverse-text"}]'])
    assert _after_trainer(resolve_here(with_eval, {"PATH": "/usr/bin"})) == "the final evaluation"


@pytest.mark.parametrize("attn", ["flash_attn", "flash_attn4"])
def test_a_gpu_attention_kernel_on_a_cpu_run_is_refused_before_anything_starts(tmp_path, attn):
    """It was the trainer's error once the inference server had loaded (28 s into a CPU run)."""
    args = ["@", str(Path(__file__).parent / "rl_example.toml"), "--output-dir", str(tmp_path)]
    with pytest.raises(ValueError, match=rf"^trainer.init.attn = {attn} needs a GPU; use auto \(or sdpa\) on CPU$"):
        resolve_here(load_config(RLConfig, [*args, "--trainer.init.attn", attn]), {"PATH": "/usr/bin"})
