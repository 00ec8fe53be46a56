"""rl with runs (multi-tenant LoRA): the plan (one inference, one trainer, one orchestrator per run), its
validation errors, and a launch with fake processes that finishes, summarizes each run, and tears down on a
failing orchestrator."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prime_core.config import ConfigError, load_config
from prime_core.config.rl import RLConfig
from prime_launch.launcher import resolve_here

from tests.launch.launch_fakes import HERE
from tests.launch.test_rl_launcher import TEARDOWN_LIMIT_S, alive, rl_cmd, wait_for
from tests.launch.test_slurm import render

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
TWO_RUNS = ["--runs", '[{"name": "run-a"}, {"name": "run-b", "lr": 5e-4, "seed": 7}]']


def rl_config(*args: str) -> RLConfig:
    """Two runs (unless ``args`` give other ``--runs``) of a rank-8 LoRA deployment in /data/exp."""
    runs = [] if "--runs" in args else TWO_RUNS
    base = ["--output-dir", "/data/exp", "--inference.engine", "auto", "--model.lora.rank", "8"]
    return load_config(RLConfig, [*base, *runs, *args])


def test_plan_has_one_trainer_one_inference_and_an_orchestrator_per_run():
    plan = resolve_here(rl_config("--inference.server.port", "8123"), CPU_ONLY, cores=4)
    assert list(plan.configs) == ["inference", "orchestrator-run-a", "orchestrator-run-b", "trainer"]
    assert [s.name for s in plan.specs] == list(plan.configs)
    assert plan.orchestrators == ["orchestrator-run-a", "orchestrator-run-b"]
    run_a, run_b = Path("/data/exp/runs/run-a"), Path("/data/exp/runs/run-b")
    assert {name: d.root for name, d in plan.runs.items()} == {"run-a": run_a, "run-b": run_b}

    trainer = plan.configs["trainer"]
    assert trainer.output_dir == Path("/data/exp")
    assert [(r.name, r.output_dir, r.lr) for r in trainer.runs] == [("run-a", run_a, None), ("run-b", run_b, 5e-4)]
    for name, run_dir, seed in (("run-a", run_a, 0), ("run-b", run_b, 7)):
        orch = plan.configs[f"orchestrator-{name}"]
        assert orch.output_dir == run_dir and orch.model.lora.name == name and orch.seed == seed
        assert orch.model.lora.rank == 8 and orch.client.base_urls == ["http://127.0.0.1:8123"]
    assert plan.health_urls == ["http://127.0.0.1:8123/health"]

    specs = {s.name: s for s in plan.specs}
    for name in plan.orchestrators:
        spec = specs[name]
        assert Path(spec.cmd[0]).name == "orchestrator"
        assert spec.cmd[1:3] == ["@", f"/data/exp/configs/{name}.toml"]
        assert spec.log_file == Path(f"/data/exp/logs/{name}.log")
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "" and spec.env["OMP_NUM_THREADS"] == "1"
        assert plan.devices[name] == "CPU, 1 thread"
    assert set(plan.devices) == set(plan.configs)
    # The orchestrators' one thread each does not count against the cores inference and trainer share.
    assert specs["inference"].env["OMP_NUM_THREADS"] == "2" and specs["trainer"].env["OMP_NUM_THREADS"] == "2"


def test_run_overrides_and_explicit_dirs():
    runs = '[{"name": "a", "output_dir": "/elsewhere/a", "env": [{"id": "reverse-text", "args": {"n": 1}}]}, {"name": "b"}]'
    cfg = load_config(
        RLConfig,
        ["--output-dir", "/data/exp", "--model.lora.rank", "8", "--runs", runs, "--wandb.name", "exp", "--seed", "3"],
    )
    plan = resolve_here(cfg, CPU_ONLY)
    a, b = plan.configs["orchestrator-a"], plan.configs["orchestrator-b"]
    assert a.output_dir == Path("/elsewhere/a") and b.output_dir == Path("/data/exp/runs/b")
    assert a.env[0].args == {"n": 1} and b.env == cfg.orchestrator.env
    assert a.seed == b.seed == 3
    assert a.monitor.wandb.name == "exp-a" and b.monitor.wandb.name == "exp-b"
    assert plan.configs["trainer"].monitor.wandb.name == "exp"


def test_confined_server_may_read_every_runs_adapters():
    plan = resolve_here(rl_config("--inference.server.weight-roots", '["/data/exp/weights"]'), CPU_ONLY)
    roots = plan.configs["inference"].server.weight_roots
    assert roots == [
        Path("/data/exp/weights"),
        Path("/data/exp/runs/run-a/weights"),
        Path("/data/exp/runs/run-b/weights"),
    ]
    assert resolve_here(rl_config(), CPU_ONLY).configs["inference"].server.weight_roots == []  # unconfined stays so


def test_gpu_plan_keeps_orchestrators_off_the_gpus():
    plan = resolve_here(rl_config(), {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/usr/bin"}, cores=16)
    env = {s.name: s.env for s in plan.specs}
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == "0" and env["trainer"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["orchestrator-run-a"]["CUDA_VISIBLE_DEVICES"] == env["orchestrator-run-b"]["CUDA_VISIBLE_DEVICES"] == ""


def test_more_runs_than_served_adapters_raises_max_loras():
    runs = "[" + ", ".join(f'{{"name": "r{i}"}}' for i in range(10)) + "]"
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--model.lora.rank", "8", "--runs", runs])
    assert cfg.inference.lora.max_loras == 8  # the resolver derives it; the user's config stays as given
    assert resolve_here(cfg, CPU_ONLY).configs["inference"].lora.max_loras == 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.lora", "null"], r"runs \(multi-tenant LoRA\) needs model.lora"),
        (["--runs", '[{"name": "a"}, {"name": "a"}]'], r"runs: names must be unique, got \['a', 'a'\]"),
        (["--runs", '[{"name": "a b"}]'], "runs.0.name"),
        (["--runs", '[{"name": "a", "output_dir": "/x"}, {"name": "b", "output_dir": "/x"}]'], "its own output_dir"),
        (["--runs", '[{"name": "a", "output_dir": "/data/exp"}]'], "distinct from the shared output_dir"),
        (["--transport.type", "zmq"], "use transport.type = 'filesystem'"),
        (["--inference.lora.max-loras", "1"], r"max_loras \(1\) < number of runs \(2\)"),
        (
            ["--inference.lora.max-loras", "1", "--inference.lora.max-cpu-loras", "1"],
            r"max_cpu_loras \(1\) < number of runs \(2\)",
        ),
        (["--trainer.runs", '[{"name": "x", "output_dir": "/x"}]'], "trainer.runs is filled by rl"),
    ],
)
def test_invalid_runs_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        rl_config(*args)
    assert "\n" not in str(e.value)


def fake_runs_cmd(out: Path, *extra: str) -> list[str]:
    return rl_cmd(out, "--model.lora.rank", "8", "--runs", '[{"name": "run-a"}, {"name": "run-b"}]', *extra)


def test_fake_multi_tenant_launch_finishes_and_summarizes_each_run(tmp_path, rl_env):
    out = tmp_path / "run"
    dry = subprocess.run(fake_runs_cmd(out, "--dry-run"), env=rl_env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"orchestrator @ {out}/configs/orchestrator-run-b.toml --log.file false" in dry.stdout
    result = subprocess.run(fake_runs_cmd(out), env=rl_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("run-a", "run-b"):
        assert f"summary of run {name}:" in result.stdout
        assert (out / "runs" / name / "metrics.jsonl").is_file()  # the fake orchestrator writes its output_dir
        assert "orchestrator started with @" in (out / "logs" / f"orchestrator-{name}.log").read_text()
    assert "trainer finished" in result.stdout
    # --overwrite clears each run's directory too (the fake orchestrator logs max_steps = 5 records).
    again = subprocess.run(fake_runs_cmd(out, "--overwrite"), env=rl_env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert len((out / "runs" / "run-a" / "metrics.jsonl").read_text().splitlines()) == 5
    # A run directory holding another run is refused like the shared one.
    for name in ("configs", "logs", "pids"):
        shutil.rmtree(out / name)
    (out / "metrics.jsonl").unlink()
    refused = subprocess.run(fake_runs_cmd(out), env=rl_env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and f"{out}/runs/run-a holds another run" in refused.stderr


def test_failing_orchestrator_of_one_run_stops_the_deployment(tmp_path, rl_env):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        fake_runs_cmd(out),
        env={**rl_env, "FAKE_HANG": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pid_files = [out / "pids" / "trainer", out / "pids" / "inference"]
    pid_files += [out / "runs" / name / "pids" / "orchestrator" for name in ("run-a", "run-b")]
    wait_for(lambda: all(f.is_file() and f.read_text().strip() for f in pid_files), 60, "every fake process")
    wait_for(lambda: "trainer ready" in (out / "logs" / "trainer.log").read_text(), 60, "the fake trainer")
    pids = [int(p) for f in pid_files for p in f.read_text().split()]
    start = time.monotonic()
    os.kill(int(pid_files[3].read_text().split()[0]), signal.SIGKILL)
    output, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < TEARDOWN_LIMIT_S
    assert proc.returncode == 1
    assert "error: orchestrator-run-b was killed by SIGKILL" in output
    for pid in pids:
        assert not alive(pid), pid


def test_slurm_single_node_job_carries_absolute_run_dirs_and_multi_node_refuses_runs(tmp_path):
    runs = ("--model.lora.rank", "8", "--runs", '[{"name": "a"}, {"name": "b", "output_dir": "rel/b"}]')
    single = render(tmp_path, "rl", "@", str(HERE / "rl_example.toml"), *runs)
    assert single.returncode == 0, single.stderr
    rl_toml = (tmp_path / "run" / "slurm" / "rl.toml").read_text()
    assert f'output_dir = "{tmp_path}/run/runs/a"' in rl_toml and f'output_dir = "{Path("rel/b").resolve()}"' in rl_toml
    multi = render(tmp_path, "rl", "@", str(HERE / "rl_example.toml"), *runs, "--slurm.num-inference-nodes", "1")
    assert multi.returncode == 2 and "use the single-node-rl template" in multi.stderr
