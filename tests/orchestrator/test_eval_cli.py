"""``eval``'s user-facing failures: one line on stderr, a non-zero exit, no wait; its help states real defaults."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from prime_core.config.orchestrator import EvalConfig

from tests.tiny import free_port

MODEL = Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "model"


def eval_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_orchestrator.entrypoints.eval", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_no_server_is_one_line_and_fast(tmp_path):
    for url in (f"http://127.0.0.1:{free_port()}/v1", f"http://127.0.0.1:{free_port()}"):
        t0 = time.monotonic()
        out = eval_cli("--client.base-url", url, "--output-dir", str(tmp_path), "--model.name", str(MODEL))
        assert time.monotonic() - t0 < 60  # not the 300 s health wait
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "no inference server at" in lines[0], out.stderr
        assert "Traceback" not in out.stderr


def test_missing_step_is_one_line_before_any_eval(tmp_path):
    weights = tmp_path / "outputs" / "weights"
    (weights / "step_2").mkdir(parents=True)
    # The relative weights dir resolves where eval runs; step 3 does not exist: one line, exit 2, nothing evaluated.
    out = eval_cli(
        "--weights-dir", "outputs/weights", "--steps", "2,3", "--client.base-url", "http://127.0.0.1:9", cwd=tmp_path
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "steps" in lines[0] and "step_3" in lines[0] and "step_2" in lines[0], out.stderr
    assert not (tmp_path / "outputs" / "eval").exists()


def test_relative_weights_dir_resolves_on_the_client(tmp_path, monkeypatch):
    (tmp_path / "outputs" / "weights" / "step_1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    config = EvalConfig.model_validate({"weights_dir": "outputs/weights", "steps": [1]})
    assert config.weights_dir == tmp_path / "outputs" / "weights"


def test_base_url_with_v1_names_the_same_server():
    a = EvalConfig.model_validate({"client": {"base_url": "http://127.0.0.1:8001/v1"}})
    b = EvalConfig.model_validate({"client": {"base_url": "http://127.0.0.1:8001"}})
    assert a.client.base_urls == b.client.base_urls == ["http://127.0.0.1:8001"]


def test_help_states_the_real_temperature_default():
    out = eval_cli("--help")
    lines = out.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if "--sampling.temperature" in line)
    assert "(default: 0.0)" in lines[i]
    assert EvalConfig().sampling.temperature == 0.0


def test_a_judge_endpoint_that_does_not_answer_is_one_line_before_any_rollout(tmp_path):
    """A server that only answers /health stands in for the policy's; the judges point at a port nobody serves."""
    import http.server
    import os
    import threading

    from tests.fixtures.vf import vf_envs_path

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's hook name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    env = {**os.environ, "PYTHONPATH": vf_envs_path()}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "prime_orchestrator.entrypoints.eval", "--environment-ids", "vf-rubric",
             "--client.base-url", f"http://127.0.0.1:{server.server_port}", "--model.name", str(MODEL),
             "--judge.base-url", dead, "--judge.model", "judge", "--output-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"eval: judge endpoint {dead} (taskset.task.judges.0 of env vf-rubric) does not answer")
    assert not (tmp_path / "eval").exists()


def test_an_env_whose_every_rollout_failed_is_one_line_exit_1_after_its_results(tmp_path, monkeypatch, capsys):
    """Every rollout failed (verifiers' openenv taskset without ``openenv``: ModuleNotFoundError per rollout): eval
    used to print reward 0.0000 and exit 0. The env servers and the inference server are stood in for; the
    rollouts' outcome is what ``evaluate_env`` reports. (tests/environments/test_vf_tasksets.py runs it for real.)"""
    import json

    import pytest
    from prime_orchestrator.entrypoints.eval import main

    async def evaluate(runner, **kwargs):
        rows = [{"example": i, "failed": True, "reward": 0.0, "error": "OpenEnvEnv.run(): ModuleNotFoundError: No "
                 "module named 'openenv'"} for i in range(2)]  # fmt: skip
        return {"reward/mean": 0.0, "reward/std": 0.0, "num_examples": 2, "rollouts_per_example": 1, "failed": 2}, rows

    stub_envs(monkeypatch, evaluate)
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(MODEL), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path)])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: env reverse-text (base): all 2 rollouts failed, e.g. OpenEnvEnv.run(): ModuleNotFoundError: No module "
        "named 'openenv'"
    )
    assert json.loads((tmp_path / "eval" / "base" / "reverse-text.json").read_text())["summary"]["failed"] == 2


def stub_envs(monkeypatch, evaluate=None):
    """The env servers and the inference server's health are stood in for; weight swaps go to the real client."""
    from prime_orchestrator import eval_runner

    class Runner:
        def __init__(self, env, spec, max_retries):
            self.spec = spec

        async def start(self):
            pass

        async def close(self):
            pass

    async def nothing(*args, **kwargs):
        pass

    async def scored(runner, **kwargs):
        summary = {"reward/mean": 0.5, "reward/std": 0.5, "num_examples": 2, "rollouts_per_example": 1, "failed": 0}
        return summary, [{"example": i, "failed": False, "reward": float(i), "error": None} for i in range(2)]

    monkeypatch.setattr(eval_runner, "EnvRunner", Runner)
    monkeypatch.setattr(eval_runner, "evaluate_env", evaluate or scored)
    monkeypatch.setattr(eval_runner.inference, "wait_healthy", nothing)
    monkeypatch.setattr(eval_runner.inference, "reload_weights", nothing)
