"""A new user's mistakes with `rl` and `inference` (issue: the first hour): a port held by another server, a
foreign server answering, a server that served another run or serves another model, a start that failed before
its first step, and the run summary's mismatch KL. Each outcome is what the user sees: one line and an exit code,
nothing started or left running, nothing carried over."""

import asyncio
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prime_launch.metrics import format_summary
from prime_launch.servers import StartupFailed, wait_healthy

from tests.launch.launch_fakes import HERE, free_port


class FakeServer:
    """An inference server started separately (another run's): /health reports its state, /reload_weights
    goes back to the base weights. Records every request path in order."""

    def __init__(
        self, weight_step: int = 0, weight_dir: str | None = None, run_id: str | None = None, model: str | None = None
    ):
        self.state = {"status": "ok", "weight_step": weight_step, "weight_dir": weight_dir, "run_id": run_id}
        if model is not None:
            self.state.update(model=model, model_name=model)
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.requests.append(f"GET {self.path}")
                self._send(200, outer.state) if self.path == "/health" else self._send(404, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append(f"POST {self.path}")
                if self.path != "/reload_weights":
                    return self._send(404, {})
                outer.state.update(weight_step=0, weight_dir=None)
                self._send(200, {"status": "ok", "weight_step": 0})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers: list[FakeServer] = []

    def make(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def rl(out: Path, env: dict[str, str], *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "prime_launch.entrypoints.rl", "--output-dir", str(out), "--stop-grace", "3", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_port_held_by_another_server_is_one_line(tmp_path, rl_env, server):
    other = server(run_id="another-run")
    proc, took = rl(
        tmp_path / "run", rl_env, "@", str(HERE / "rl_example.toml"), "--inference.server.port", str(other.port)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: inference.server.port: port "), proc.stderr
    assert f"port {other.port} on 127.0.0.1 is already in use" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists() and not (tmp_path / "run" / "pids").exists(), "nothing started"
    assert other.requests == [], "the other server was not taken for ours"
    assert took < 20, took


def test_foreign_server_answering_is_refused(server):
    other = server(run_id="another-run")
    url = f"http://127.0.0.1:{other.port}/health"
    with pytest.raises(StartupFailed, match="answered by another server"):
        wait_healthy([url], None, 10, lambda: None, run_id="this-run")
    assert wait_healthy([url], None, 10, lambda: None, run_id="another-run")[url].run_id == "another-run"


def test_orchestrator_waits_for_its_own_server(server):
    """An orchestrator started beside rl's inference server counts only an answer carrying the run's id; a foreign
    server on the port is the launcher's to report (it stops the run), so the orchestrator sends it nothing."""
    from prime_orchestrator.client import wait_healthy as orchestrator_wait

    other = server(run_id="another-run")
    url = f"http://127.0.0.1:{other.port}"
    with pytest.raises(TimeoutError, match="not healthy after 1s"):
        asyncio.run(orchestrator_wait([url], api_key=None, timeout=1.0, run_id="this-run"))
    other.state["run_id"] = "this-run"
    asyncio.run(orchestrator_wait([url], api_key=None, timeout=5.0, run_id="this-run"))
    other.state["run_id"] = None  # a server started separately: no run id is expected of it
    asyncio.run(orchestrator_wait([url], api_key=None, timeout=5.0))
    assert set(other.requests) == {"GET /health"}


def test_server_of_another_run_serves_step0_weights_first(tmp_path, rl_env, server):
    """rl without [inference] against a server left at another run's step 3: the base weights are reloaded
    before the orchestrator starts, and the user is told."""
    other = server(weight_step=3, weight_dir="/elsewhere/weights/step_3")
    config = tmp_path / "no_inference.toml"
    text = (HERE / "rl_example.toml").read_text().replace("[inference]\n", "")
    config.write_text(text)
    base_url = f"http://127.0.0.1:{other.port}/v1"
    proc, _ = rl(tmp_path / "run", rl_env, "@", str(config), "--orchestrator.client.base-urls", base_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "POST /reload_weights" in other.requests and other.state["weight_step"] == 0
    reloaded = proc.stdout.index("served weights of step 3 (/elsewhere/weights/step_3); reloaded its base weights")
    assert reloaded < proc.stdout.index("starting orchestrator and trainer")
    # A server already at step 0 is left alone.
    other.requests.clear()
    proc, _ = rl(tmp_path / "run2", rl_env, "@", str(config), "--orchestrator.client.base-urls", base_url)
    assert proc.returncode == 0 and "POST /reload_weights" not in other.requests


def test_server_of_another_model_is_refused(tmp_path, rl_env, server):
    """A separately started server whose model is not this run's: its base weights are not the run's step-0
    weights, so rl refuses with one line before the orchestrator or trainer starts, and leaves the server as it is."""
    other = server(weight_step=3, weight_dir="/elsewhere/weights/step_3", model="other-model")
    config = tmp_path / "no_inference.toml"
    config.write_text((HERE / "rl_example.toml").read_text().replace("[inference]\n", ""))
    base_url = f"http://127.0.0.1:{other.port}/v1"
    proc, took = rl(tmp_path / "run", rl_env, "@", str(config), "--orchestrator.client.base-urls", base_url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == (
        f"error: the inference server at http://127.0.0.1:{other.port} serves model 'other-model', not this run's "
        "model.name 'tiny-model'; start it with --model.name tiny-model or train its model\n"
    ), proc.stdout + proc.stderr
    assert "starting orchestrator and trainer" not in proc.stdout
    assert not list((tmp_path / "run" / "logs").glob("*.log")), "neither orchestrator nor trainer started"
    assert other.requests == ["GET /health"] and other.state["weight_step"] == 3, "the server was left alone"
    assert took < 20, took
    # The same server under this run's model.name (its served name may differ) is used.
    other.state.update(model="served-alias", model_name="tiny-model")
    proc, _ = rl(tmp_path / "run2", rl_env, "@", str(config), "--orchestrator.client.base-urls", base_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_failed_start_does_not_block_the_directory(tmp_path, rl_env):
    out = tmp_path / "run"
    example = ("@", str(HERE / "rl_example.toml"), "--inference.server.port", str(free_port()))
    failed, _ = rl(out, {**rl_env, "FAKE_START_FAIL": "1"}, *example)
    assert failed.returncode == 1
    stale = out / "rollouts" / "step_0" / "rank_0.bin"  # what a step-0 orchestrator may have left
    stale.parent.mkdir(parents=True)
    stale.write_text("stale")
    assert not (out / "metrics.jsonl").exists()
    proc, _ = rl(out, rl_env, *example)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cleared the leftovers of a start that failed before its first step" in proc.stdout
    assert not stale.exists(), "nothing of the failed start carries over"
    # A run that trained is still refused without --overwrite / --resume.
    proc, _ = rl(out, rl_env, *example)
    assert proc.returncode == 2 and "holds another run" in proc.stderr


def test_summary_shows_a_tiny_mismatch_kl():
    summary = {"trainer_steps": 2, "reward_first": 0.1, "reward_last": 0.2, "mismatch_kl_max": 3e-9, "loss_last": 0.5}
    assert "max mismatch KL          3e-09" in format_summary(summary)


def test_inference_port_in_use_is_one_line_before_loading(tmp_path, server):
    other = server()
    model_dir = tmp_path / "model"  # never loaded: the port is checked first
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3"}')
    (model_dir / "tokenizer_config.json").write_text("{}")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--model.name", str(model_dir),
         "--server.host", "127.0.0.1", "--server.port", str(other.port), "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"error: server.port: port {other.port} on 127.0.0.1 is already in use (another server is listening there); "
        "stop that server or choose another --server.port\n"
    )
    assert time.monotonic() - start < 20


def test_real_server_reports_the_run_id_rl_gave_it(tmp_path):
    """The contract behind the foreign-server and model checks: `inference` reports its PRIME_RUN_ID and its
    model in /health."""
    import os
    import signal

    port = free_port()
    model = Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "model"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--model.name", str(model), "--server.port",
         str(port), "--output-dir", str(tmp_path), "--log.file", "false"],
        env={**os.environ, "PRIME_RUN_ID": "run-abc", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/health"

    def alive() -> None:
        assert proc.poll() is None, "the inference server exited"

    try:
        answer = wait_healthy([url], None, 120, alive, run_id="run-abc")[url]
        assert answer.run_id == "run-abc" and answer.model == answer.model_name == str(model)
        with pytest.raises(StartupFailed, match="answered by another server"):
            wait_healthy([url], None, 10, alive, run_id="run-xyz")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
