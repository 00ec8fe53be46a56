"""The wall clock steps (NTP, a VM resumed, an admin's `date -s`) under a running `rl` with stand-in processes
(tests/launch/fake_process.py): the watchdog's bounds are measured on the launcher's monotonic clock, so a step forward
kills no healthy run and a step back hides no stuck process. Every process reads an offset added to ``time.time()``
from a file (a ``sitecustomize`` on their path); the launcher's and the children's files are separate, so a step is
seen by the launcher before the children's next heartbeat, as it is for up to a heartbeat interval on a real host."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.test_rl_launcher import alive, pids_of, rl_cmd, wait_for

SLACK_S = 3.0
DETECT_LIMIT_S = SLACK_S + 12.0  # as tests/faults/test_watchdog.py: a heartbeat and a check interval, a loaded host

SITE = """
import os, sys, threading, time
_real, _offset = time.time, [0.0]
_child = os.path.basename(sys.argv[0]) in ("trainer", "orchestrator", "inference")
_path = os.path.join(os.environ["FAKE_CLOCK_DIR"], "children" if _child else "launcher")


def _follow():
    while True:
        try:
            _offset[0] = float(open(_path).read() or 0)
        except (OSError, ValueError):
            pass
        _real_sleep(0.05)


_real_sleep = time.sleep
time.time = lambda: _real() + _offset[0]
threading.Thread(target=_follow, daemon=True).start()
"""


def start(tmp_path: Path, rl_env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path]:
    site, clocks = tmp_path / "site", tmp_path / "clocks"
    site.mkdir()
    clocks.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = {**rl_env, "FAKE_HANG": "1", "FAKE_CLOCK_DIR": str(clocks),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), rl_env.get("PYTHONPATH")]))}  # fmt: skip
    out = tmp_path / "run"
    args = rl_cmd(out, "--liveness.slack-s", str(SLACK_S), "--console", "quiet")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "logs" / "trainer.log"
    wait_for(lambda: len(pids_of(out)) == 3 or proc.poll() is not None, 60, "three fake processes")
    wait_for(lambda: (log.exists() and "ready" in log.read_text()) or proc.poll() is not None, 60, "the steps")
    assert proc.poll() is None, proc.communicate()
    return proc, out, clocks


def step_clock(clocks: Path, seconds: float, *, children_after_s: float) -> None:
    (clocks / "launcher").write_text(str(seconds))
    time.sleep(children_after_s)
    (clocks / "children").write_text(str(seconds))


def stop(proc: subprocess.Popen, out: Path) -> tuple[str, str]:
    pids = pids_of(out)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for group in pids.values():
        for pid in group:
            os.kill(pid, signal.SIGCONT) if alive(pid) else None
    wait_for(lambda: not any(alive(p) for group in pids.values() for p in group), 30, "every fake to be gone")
    return stdout, stderr


def still_running_past_the_slack(proc: subprocess.Popen) -> bool:
    """Whether a healthy run is still going after the liveness slack has passed twice (several watchdog checks)."""
    deadline = time.monotonic() + 2 * SLACK_S + 3
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc.poll() is None


def assert_kept_and_stopped_cleanly(proc: subprocess.Popen, running: bool, stderr: str) -> None:
    assert running, stderr
    assert proc.returncode == 128 + signal.SIGTERM and stderr == "", stderr


def test_a_clock_step_forward_kills_no_healthy_run(tmp_path, rl_env):
    proc, out, clocks = start(tmp_path, rl_env)
    try:
        step_clock(clocks, 3600, children_after_s=2.0)
        running = still_running_past_the_slack(proc)  # several checks on the stepped clock
    finally:
        stdout, stderr = stop(proc, out)
    assert_kept_and_stopped_cleanly(proc, running, stderr)


def test_a_clock_step_back_hides_no_stopped_process(tmp_path, rl_env):
    proc, out, clocks = start(tmp_path, rl_env)
    try:
        step_clock(clocks, -3600, children_after_s=0.0)
        time.sleep(2.0)  # every process heartbeats on the stepped clock
        os.kill(pids_of(out)["trainer"][0], signal.SIGSTOP)
        at = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):  # old code: never found (the check waited an hour)
            proc.wait(timeout=DETECT_LIMIT_S + 30)
        took = time.monotonic() - at
    finally:
        stdout, stderr = stop(proc, out)
    print(f"clock stepped back an hour, then SIGSTOP trainer: rl stopped {took:.1f} s later: {stderr.strip()}")
    assert proc.returncode == 1, stderr
    assert took < DETECT_LIMIT_S
    assert stderr.count("\n") == 1 and stderr.startswith("error: trainer is stuck: trainer rank 0 sent no heartbeat "
                                                         "for "), stderr  # fmt: skip
    assert "stopped by a signal" in stderr


def test_an_activity_is_timed_on_the_monotonic_clock(tmp_path):
    """A step began before the wall clock stepped an hour forward: it has lasted what the trainer's monotonic clock
    says (``for_s``), not an hour; past its bound on that clock it is named."""
    from prime_core.config.liveness import LivenessConfig
    from prime_core.progress import boot_id
    from prime_core.schemas.progress import Activity, Progress
    from prime_launch.watchdog import ProcessStuck, Watchdog

    path = tmp_path / "trainer_rank_0.json"
    dog = Watchdog(LivenessConfig(slack_s=10, step_timeout_s=5), run_id="run")
    dog.watch("trainer", [path])

    def beat(for_s: float) -> None:
        step = Activity(what="training step 3", kind="step", since=time.time() - 3600, for_s=for_s)
        record = Progress(process="trainer", rank=0, pid=os.getpid(), run_id="run", started=time.time(),
                          time=time.time(), monotonic=time.monotonic(), boot_id=boot_id(), activities=[step])  # fmt: skip
        path.write_text(record.model_dump_json())
        dog._last_check = None

    beat(for_s=1.0)
    dog.check()
    beat(for_s=20.0)
    with pytest.raises(ProcessStuck, match=r"trainer rank 0 has been training step 3 for 20 s, past its bound of 5 s"):
        dog.check()


def test_a_launcher_suspended_and_continued_keeps_its_healthy_run(tmp_path, rl_env):
    """Ctrl-Z on `rl` (or SIGSTOP) stops only the launcher: its children, in their own sessions, go on. Continued past
    the slack, the watchdog must not take its own sleep for their silence (before: 'inference is stuck: ... /health
    has not answered for 8 s', the probe thread having slept with it)."""
    proc, out, _ = start(tmp_path, rl_env)
    try:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(SLACK_S + 5)
        proc.send_signal(signal.SIGCONT)
        running = still_running_past_the_slack(proc)
    finally:
        stdout, stderr = stop(proc, out)
    assert_kept_and_stopped_cleanly(proc, running, stderr)
