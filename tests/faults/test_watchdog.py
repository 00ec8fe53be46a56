"""The watchdog of `rl` against stand-in processes (tests/launch/fake_process.py): a process that is alive but stuck
(stopped by SIGSTOP, silent from the start, in a step that never ends, exiting but never gone) or an inference server
that stops answering /health is found within the liveness bound, named in one line on stderr, and every process is
stopped. Seconds each: these run in CI; the same faults against the real processes are in test_rl_faults.py (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.test_rl_launcher import alive, pids_of, rl_cmd, wait_for

SLACK_S = 3.0
# Detection needs the slack plus up to a heartbeat interval and a check interval; the rest is a loaded CI machine.
DETECT_LIMIT_S = SLACK_S + 12.0


def run_until_stuck(out: Path, env: dict[str, str], fault, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """Start a run whose fakes keep running, inject ``fault(pids)`` once every fake is up, and wait for rl to stop.
    Returns rl's result and the seconds from the fault to rl's exit."""
    args = rl_cmd(out, "--liveness.slack-s", str(SLACK_S), "--console", "quiet", *extra)
    proc = subprocess.Popen(
        args, env={**env, "FAKE_HANG": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: len(pids_of(out)) == 3 or proc.poll() is not None, 60, "three fake processes")
        log = out / "logs" / "trainer.log"
        wait_for(lambda: (log.exists() and "ready" in log.read_text()) or proc.poll() is not None, 60, "the steps")
        pids = pids_of(out)
        start = time.monotonic()
        fault(pids)
        stdout, stderr = proc.communicate(timeout=DETECT_LIMIT_S + 30)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    for name, group in pids.items():
        for pid in group:
            os.kill(pid, signal.SIGCONT) if alive(pid) else None
            assert not alive(pid), f"{name} (or its child) {pid} survived"
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), took


def one_line_cause(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr


@pytest.mark.parametrize("victim", ["trainer", "orchestrator"])
def test_stopped_process_is_named_with_what_it_was_doing(tmp_path, rl_env, victim):
    result, took = run_until_stuck(tmp_path / "run", rl_env, lambda pids: os.kill(pids[victim][0], signal.SIGSTOP))
    cause = one_line_cause(result)
    print(f"SIGSTOP {victim}: detected and stopped in {took:.1f} s: {cause}")
    assert took < DETECT_LIMIT_S
    name = "trainer rank 0" if victim == "trainer" else victim
    assert f"error: {victim} is stuck: {name} sent no heartbeat for" in cause
    assert "stopped by a signal" in cause and "; it was idle" in cause


def test_stopped_inference_server_is_found_by_its_health_probe(tmp_path, rl_env):
    result, took = run_until_stuck(tmp_path / "run", rl_env, lambda pids: os.kill(pids["inference"][0], signal.SIGSTOP))
    cause = one_line_cause(result)
    print(f"SIGSTOP inference: detected and stopped in {took:.1f} s: {cause}")
    assert took < DETECT_LIMIT_S
    assert "error: inference is stuck: http://127.0.0.1:" in cause and "/health has not answered for" in cause
    assert "stopped by a signal" in cause and ("the last request has waited" in cause or "timed out" in cause)


def test_step_that_never_ends_is_past_its_bound(tmp_path, rl_env):
    env = {**rl_env, "FAKE_STALL_AT": "2"}
    result, took = run_until_stuck(tmp_path / "run", env, lambda pids: None, "--liveness.step-timeout-s", "1")
    cause = one_line_cause(result)
    assert "error: trainer is stuck: trainer rank 0 has been training step 2 for" in cause
    assert "past its bound of 1 s + 3 s slack" in cause


def test_process_that_never_reports_is_found_after_its_startup_allowance(tmp_path, rl_env):
    env = {**rl_env, "FAKE_NO_HEARTBEAT": "orchestrator"}
    result, _ = run_until_stuck(tmp_path / "run", env, lambda pids: None, "--liveness.startup-s", "2")
    cause = one_line_cause(result)
    assert "error: orchestrator is stuck: it wrote no heartbeat to" in cause and "since it started" in cause


def test_process_that_finished_but_does_not_exit(tmp_path, rl_env):
    """prime-rl #2912: a deadlock after the last step held the job's nodes for hours."""
    env = {**rl_env, "FAKE_EXIT_HANG": "orchestrator"}
    result, _ = run_until_stuck(tmp_path / "run", env, lambda pids: None)
    cause = one_line_cause(result)
    assert "error: orchestrator is stuck: orchestrator finished its work" in cause and "but has not exited" in cause
