"""The same under SLURM (a real single-node cluster, PLATFORM.md "SLURM on one machine"; slow, root + apt): a job
whose trainer is stopped by SIGSTOP ends, FAILED, within the liveness bound, with one line naming it. The single-node
template runs `rl`, whose watchdog stops the run; the multi-node template runs `prime-launch watch` beside its steps.
The processes are the launcher tests' stand-ins (tests/launch/fake_process.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.launch.launch_fakes import HERE, free_port
from tests.launch.test_rl_launcher import pids_of, wait_for
from tests.launch.test_slurm import CLI, _wait_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]
SLACK_S = 5


def submit(out: Path, env: dict[str, str], fake_bin: Path, fake_hf_cache: Path, *extra: str) -> str:
    bin_dir = Path(sys.executable).parent
    result = subprocess.run(
        [
            *CLI, "rl", "@", str(HERE / "rl_example.toml"), "--output-dir", str(out),
            "--inference.server.port", str(free_port()), "--liveness.slack-s", str(SLACK_S),
            "--slurm.gpus-per-node", "0", "--slurm.exclusive", "false", "--slurm.time", "5:00",
            "--slurm.launcher", "none", "--slurm.job-name", "prime-fault",
            *extra,
            "--slurm.setup", f"export PATH={fake_bin}:{bin_dir}:$PATH", f"export PRIME_LAUNCH_BIN_DIR={fake_bin}",
            f"export HF_HUB_CACHE={fake_hf_cache}", "export CUDA_VISIBLE_DEVICES= FAKE_HANG=1",
        ],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[2]


def stop_trainer_and_wait(out: Path, job_id: str, env: dict[str, str]) -> tuple[str, str, float]:
    log = out / "logs" / "trainer.log"
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 180, "the fake trainer's steps")
    trainer = pids_of(out)["trainer"][0]
    os.kill(trainer, signal.SIGSTOP)
    start = time.monotonic()
    state = _wait_job(job_id, env, 120)
    took = time.monotonic() - start
    job_log = (out / "slurm" / f"job_{job_id}.log").read_text()
    return state, job_log, took


def test_single_node_job_ends_when_rl_finds_a_stuck_trainer(tmp_path, slurm_cluster, fake_bin, fake_hf_cache):
    out = tmp_path / "run"
    job_id = submit(out, slurm_cluster, fake_bin, fake_hf_cache)
    state, job_log, took = stop_trainer_and_wait(out, job_id, slurm_cluster)
    print(f"single-node job {job_id} ended {took:.1f} s after SIGSTOP of the trainer")
    assert "JobState=FAILED" in state, state + job_log
    assert "error: trainer is stuck: trainer rank 0 sent no heartbeat for" in job_log, job_log
    assert took < SLACK_S + 30


class _Health:
    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"status": "ok", "weight_step": 0}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_multi_node_job_ends_when_its_watchdog_finds_a_stuck_trainer(tmp_path, slurm_cluster, fake_bin, fake_hf_cache):
    """multi-node-rl on the one node: the trainer under srun + torchrun, the orchestrator under srun, inference
    outside the job (a stand-in /health); the stuck trainer rank is found by `prime-launch watch`."""
    out = tmp_path / "run"
    server = _Health()
    # The job's steps make their private TMPDIRs under this one; the job's EXIT trap removes them on every node.
    node_tmp = tmp_path / "node_tmp"
    node_tmp.mkdir()
    env = {**slurm_cluster, "TMPDIR": str(node_tmp)}
    try:
        job_id = submit(
            out, env, fake_bin, fake_hf_cache, "--slurm.num-inference-nodes", "0", "--slurm.num-trainer-nodes",
            "1", "--slurm.inference-url", server.url, "--slurm.master-port", str(free_port()),
        )  # fmt: skip
        log = out / "logs" / "trainer.log"
        wait_for(lambda: log.exists() and "ready" in log.read_text(), 180, "the fake trainer's steps")
        steps = sorted(p.name for p in (node_tmp / f"prime-{job_id}").iterdir())
        state, job_log, took = stop_trainer_and_wait(out, job_id, env)
    finally:
        server.httpd.shutdown()
    assert {"orchestrator", "trainer"} <= set(steps), steps
    assert not list(node_tmp.glob("prime-*")), list(node_tmp.rglob("*"))[:20]  # the steps were killed, not exited
    print(f"multi-node job {job_id} ended {took:.1f} s after SIGSTOP of the trainer rank")
    assert "JobState=FAILED" in state, state + job_log
    assert "job: error: trainer is stuck: trainer rank 0 sent no heartbeat for" in job_log, job_log
    assert "job: watchdog exited (code 1), stopping every step" in job_log
    assert took < SLACK_S + 30
