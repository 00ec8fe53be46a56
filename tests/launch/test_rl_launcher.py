"""The rl launcher with fake process commands: dry run, normal finish, failure and signal teardown, reuse guard."""

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.launch.launch_fakes import HERE, free_port

TEARDOWN_LIMIT_S = 10.0


def rl_cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "prime_launch.entrypoints.rl",
        "@",
        str(HERE / "rl_example.toml"),
        "--output-dir",
        str(out),
        "--inference.server.port",
        str(free_port()),
        "--stop-grace",
        "3",
        *extra,
    ]


def pids_of(out: Path) -> dict[str, list[int]]:
    found = {}
    for f in (out / "pids").glob("*"):
        found[f.name] = [int(p) for p in f.read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def as_from_a_terminal() -> None:
    """In the child before exec: SIGINT and SIGHUP as a terminal's shell leaves them. A worker of this suite may hold
    them ignored (a background job, or a library that ignored them), and rl keeps a signal that was ignored at its
    start ignored, so a test's Ctrl-C would wait in vain (the CI run that found it: three SIGINT tests timed out)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start_hanging_run(out: Path, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(
        rl_cmd(out),
        env={**env, "FAKE_HANG": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    log = out / "logs" / "trainer.log"
    wait_for(lambda: log.exists() and "trainer ready" in log.read_text(), 60, "the fake trainer")
    wait_for(lambda: len(pids_of(out)) == 3, 10, "three pid files")
    return proc


def test_dry_run_writes_configs_and_prints_commands(tmp_path, rl_env):
    out = tmp_path / "run"
    result = subprocess.run(rl_cmd(out, "--dry-run"), env=rl_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("trainer", "orchestrator", "inference"):
        assert (out / "configs" / f"{name}.toml").is_file()
        assert f"{name} @ {out / 'configs' / name}.toml --log.file false" in result.stdout
    assert not (out / "logs").exists(), "a dry run starts nothing"
    orch = (out / "configs" / "orchestrator.toml").read_text()
    assert "max_steps = 5" in orch and 'name = "tiny-model"' in orch
    # A dry run does not make the directory "another run": a second dry run and a real launch are allowed.
    again = subprocess.run(rl_cmd(out, "--dry-run"), env=rl_env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr


def test_normal_finish_exits_zero_and_summarizes(tmp_path, rl_env):
    out = tmp_path / "run"
    result = subprocess.run(rl_cmd(out), env=rl_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainer finished" in result.stdout
    assert "reward, first 3 steps  0.1000" in result.stdout  # mean(0.0, 0.1, 0.2)
    assert "reward, last 3 steps   0.3000" in result.stdout  # mean(0.2, 0.3, 0.4)
    assert "max mismatch KL          0.004\n" in result.stdout
    assert "inference started with @" in (out / "logs" / "inference.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=''" in (out / "logs" / "trainer.log").read_text()
    for pid in [p for pids in pids_of(out).values() for p in pids]:
        wait_for(lambda pid=pid: not alive(pid), 5, f"pid {pid} to be gone")


def test_zmq_transport_gets_a_fresh_secret_each_launch(tmp_path, rl_env):
    """A new launch's trainer refuses the batches of an orchestrator left from the last one: rl writes a new
    transport secret (mode 0600) before it starts anything."""
    out, secrets = tmp_path / "run", []
    for extra in ((), ("--overwrite",)):
        result = subprocess.run(rl_cmd(out, "--transport.type", "zmq", *extra), env=rl_env, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        secret = out / "transport.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
        secrets.append(secret.read_bytes())
    assert len(secrets[0]) == 64 and secrets[0] != secrets[1]


def test_orchestrator_starts_beside_its_inference_server(tmp_path, rl_env):
    """With its own inference server, rl starts the orchestrator at once (its env servers start while inference
    does) and the trainer after /health; the orchestrator waits for the server carrying this run's id, as long as rl."""
    out = tmp_path / "run"
    result = subprocess.run(rl_cmd(out), env=rl_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    started = result.stdout.index("rl: started orchestrator; waiting for inference at http://127.0.0.1:")
    assert started < result.stdout.index("rl: inference is healthy; starting trainer")
    # The run id goes on the command line: the written config stays usable against any server.
    assert "--client.server-run-id " in (out / "logs" / "orchestrator.log").read_text()
    orch = tomllib.loads((out / "configs" / "orchestrator.toml").read_text())
    assert "server_run_id" not in orch["client"] and orch["client"]["health_timeout"] == 900.0  # rl's own


def test_refuses_output_dir_of_another_run(tmp_path, rl_env):
    out = tmp_path / "run"
    (out).mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "process": "trainer", "values": {}}\n')
    result = subprocess.run(rl_cmd(out), env=rl_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "holds another run" in result.stderr and "--overwrite" in result.stderr
    assert not (out / "logs").exists()
    # --overwrite clears it and runs.
    result = subprocess.run(rl_cmd(out, "--overwrite"), env=rl_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # --resume without a checkpoint is an error naming the checkpoints dir.
    result = subprocess.run(rl_cmd(out, "--resume"), env=rl_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no checkpoint" in result.stderr


def test_the_refusal_offers_resume_only_for_a_run_that_can_resume(tmp_path, rl_env):
    """A run stopped (Ctrl-C) after a step but before any checkpoint: rl said `pass --resume to continue it`, and
    `rl --resume` then said only `no checkpoint`; a finished run without checkpoints got the same line. Each refusal
    now says what can be done."""
    from prime_core.io import mark_stable
    from prime_core.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    run.weight_step(1).mkdir(parents=True)
    mark_stable(run.weight_step(1))
    run.metrics.write_text('{"step": 0, "process": "trainer", "values": {}}\n')

    def refusal(*extra: str) -> str:
        result = subprocess.run(rl_cmd(run.root, *extra), env=rl_env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stdout + result.stderr
        return result.stderr

    err = refusal()
    assert "; it has no checkpoint to resume from; pass --overwrite to delete it" in err and "--resume" not in err
    assert "(none is saved with ckpt.interval unset; set --ckpt.interval N for a run you may resume)" in refusal(
        "--resume"
    )
    assert "checkpoint counts once its trainer and orchestrator parts" in refusal("--resume", "--ckpt.interval", "1")
    run.weight_step(5).mkdir(parents=True)
    mark_stable(run.weight_step(5))  # max_steps 5: the run finished
    assert f"--resume: the run in {run.root} has finished (final weights {run.weight_step(5)})" in refusal("--resume")
    for path in (run.trainer_checkpoint(1), run.orchestrator_checkpoint(1)):
        path.mkdir(parents=True)
        mark_stable(path)
    mark_stable(run.checkpoint_step(1))
    assert "; pass --resume to continue it, --overwrite to delete it" in refusal()


def test_child_killed_tears_down_everything(tmp_path, rl_env):
    out = tmp_path / "run"
    proc = start_hanging_run(out, rl_env)
    pids = pids_of(out)
    start = time.monotonic()
    os.kill(pids["orchestrator"][0], signal.SIGKILL)
    output, _ = proc.communicate(timeout=30)
    took = time.monotonic() - start
    print(f"teardown after kill -9 of a child: {took:.2f} s")
    assert took < TEARDOWN_LIMIT_S
    assert proc.returncode != 0
    assert "error: orchestrator was killed by SIGKILL" in output
    for name, group in pids.items():
        for pid in group:
            assert not alive(pid), f"{name} (or its child) {pid} survived"


def test_failing_trainer_reports_log_tail(tmp_path, rl_env):
    out = tmp_path / "run"
    result = subprocess.run(
        rl_cmd(out), env={**rl_env, "FAKE_TRAINER_FAIL": "1"}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    # The cause is one line on stderr; the log tail around it goes to stdout.
    assert result.stderr == f"error: trainer exited with code 3 (log: {out / 'logs' / 'trainer.log'})\n"
    assert "Traceback: something broke in the trainer" in result.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_everything(tmp_path, rl_env, sig):
    """...and says what the run can continue from (before: nothing, though step 2 was resumable)."""
    from prime_core.io import mark_stable
    from prime_core.run_dir import RunDir

    out = tmp_path / "run"
    proc = start_hanging_run(out, rl_env)
    pids = pids_of(out)
    run = RunDir(out)
    for path in (run.trainer_checkpoint(2), run.orchestrator_checkpoint(2), run.weight_step(2)):
        path.mkdir(parents=True)
        mark_stable(path)
    mark_stable(run.checkpoint_step(2))  # as the fake trainer's step 2 had been saved
    start = time.monotonic()
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=30)
    assert time.monotonic() - start < TEARDOWN_LIMIT_S
    assert proc.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}" in output
    assert "rl: the newest checkpoint is step 2: the same command with --resume continues it" in output
    for group in pids.values():
        for pid in group:
            assert not alive(pid)


def test_launcher_killed_leaves_no_orphans(tmp_path, rl_env):
    out = tmp_path / "run"
    proc = start_hanging_run(out, rl_env)
    pids = pids_of(out)
    start = time.monotonic()
    proc.kill()
    proc.wait()
    everything = [p for group in pids.values() for p in group]
    wait_for(lambda: not any(alive(p) for p in everything), TEARDOWN_LIMIT_S, "every child and grandchild to die")
    print(f"orphans gone {time.monotonic() - start:.2f} s after kill -9 of the launcher")


@pytest.mark.parametrize("killed", ["orchestrator", "launcher"])
def test_a_descendant_in_its_own_session_goes_when_its_parent_or_the_launcher_is_killed(tmp_path, rl_env, killed):
    """A harness program an env worker starts with ``setsid`` is in no child's process group; once its parent is gone
    (the orchestrator killed by the OOM killer, or rl killed -9) it is in no child's tree either. Before, it outlived
    the run (found alive after rl exited); the launch's tag in its environment ends it with the rest."""
    out = tmp_path / "run"
    proc = start_hanging_run(out, {**rl_env, "FAKE_SETSID": "orchestrator"})
    daemon = int((out / "orchestrator.setsid.pid").read_text())
    everything = [daemon, *(p for group in pids_of(out).values() for p in group)]
    try:
        if killed == "orchestrator":
            os.kill(pids_of(out)["orchestrator"][0], signal.SIGKILL)
            output, _ = proc.communicate(timeout=30)
            assert proc.returncode == 1 and "error: orchestrator was killed by SIGKILL" in output
            assert not alive(daemon), "the orchestrator's setsid descendant outlived rl"
        else:
            proc.kill()
            proc.wait()
            wait_for(lambda: not any(alive(p) for p in everything), TEARDOWN_LIMIT_S, "every descendant to die")
    finally:
        for pid in everything:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# rl paused where it clears or rewinds a large output directory before any process starts (seconds on a real run).
SITE_SLOW_PREPARE = """
import os, time
if os.environ.get("SLOW_PREPARE_MARK"):
    import prime_launch.launcher as launcher
    _prepare = launcher._prepare

    def slow_prepare(*args, **kwargs):
        open(os.environ["SLOW_PREPARE_MARK"], "w").close()
        time.sleep(120)
        return _prepare(*args, **kwargs)

    launcher._prepare = slow_prepare
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_any_process_starts_is_one_line(tmp_path, rl_env, sig):
    """Before: Ctrl-C while rl prepared the directory was a KeyboardInterrupt traceback, SIGTERM ended rl silently
    (exit -15). Now both say so in one line and exit 128 + signal, having started nothing."""
    site, mark, out = tmp_path / "site", tmp_path / "preparing", tmp_path / "run"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_SLOW_PREPARE)
    env = {**rl_env, "SLOW_PREPARE_MARK": str(mark), "PYTHONPATH": str(site)}
    proc = subprocess.Popen(
        rl_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal
    )
    try:
        wait_for(lambda: mark.exists(), 60, "rl to prepare the output directory")
        proc.send_signal(sig)
        output, errors = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, output, errors)
    assert "Traceback" not in output + errors, errors
    assert f"rl: received {signal.Signals(sig).name}; no process of the run is running" in output
    assert not (out / "pids").exists()


def test_a_second_signal_waits_for_the_stop_of_the_first(tmp_path, rl_env):
    """Ctrl-C, then SIGTERM (or Ctrl-C again) while rl handles it. Before: the second was raised inside the handling of
    the first, cutting it short (its `stopping every process` line lost; before the launch caught it, a traceback).
    Now the first stops the run and the second waits for the stop."""
    out = tmp_path / "run"
    proc = start_hanging_run(out, rl_env)
    pids = pids_of(out)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)  # signals of two kinds do not merge into one, as two SIGINTs may
    output, _ = proc.communicate(timeout=30)
    assert "Traceback" not in output
    assert "rl: received SIGINT; stopping every process" in output and "received SIGTERM" not in output, output
    assert proc.returncode == 128 + signal.SIGINT
    for group in pids.values():
        for pid in group:
            wait_for(lambda pid=pid: not alive(pid), 5, f"pid {pid} to be gone")


def test_a_hang_up_ignored_at_the_start_does_not_stop_the_run(tmp_path, rl_env):
    """`nohup rl ...`: the terminal that closes sends SIGHUP, which the run asked to ignore. Before, rl took it as a stop
    (`received SIGHUP`, exit 129, every process stopped); now the run goes on and SIGTERM still stops it."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        ["nohup", *rl_cmd(out)],
        env={**rl_env, "FAKE_HANG": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = out / "logs" / "trainer.log"
    wait_for(lambda: log.exists() and "trainer ready" in log.read_text(), 60, "the fake trainer")
    pids = pids_of(out)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)  # handled after the hang-up (signals are handled in ascending order)
    output, _ = proc.communicate(timeout=30)
    assert "received SIGHUP" not in output
    assert proc.returncode == 128 + signal.SIGTERM and "rl: received SIGTERM; stopping every process" in output
    for group in pids.values():
        for pid in group:
            wait_for(lambda pid=pid: not alive(pid), 5, f"pid {pid} to be gone")


def test_a_console_whose_reader_went_away_does_not_stop_the_run(tmp_path, rl_env):
    """`rl ... | tee run.log`, and tee is gone (killed at logout). Before: rl's next line raised BrokenPipeError, which
    stopped every process of the healthy run with a traceback (exit 1, 0.3 s after). Now the run goes on to its end."""
    out = tmp_path / "run"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(rl_cmd(out), env=rl_env, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.readline().startswith(b"rl: run directory")
    _, errors = proc.communicate(timeout=120)
    assert proc.returncode == 0, errors
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
    assert "trainer ready" in (out / "logs" / "trainer.log").read_text()


def teacher_args() -> list[str]:
    env = '[{"id": "reverse-text", "distill": {}}]'
    return ["--orchestrator.env", env, "--teacher.model.name", "tiny-model", "--teacher.port", str(free_port())]


def test_teacher_starts_is_waited_for_and_stopped(tmp_path, rl_env):
    """[teacher]: a fourth process (the inference entry point on the teacher's config, its own log and run
    subdirectory), healthy before the trainer starts, and stopped with the rest."""
    out = tmp_path / "run"
    result = subprocess.run(rl_cmd(out, *teacher_args()), env=rl_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.index("rl: teacher is healthy") < result.stdout.index("rl: trainer finished")
    log = (out / "logs" / "teacher.log").read_text()
    assert f"inference started with @ {out / 'configs' / 'teacher.toml'}" in log
    teacher_pids = [int(p) for p in (out / "teacher" / "pids" / "inference").read_text().split()]
    for pid in teacher_pids + [p for pids in pids_of(out).values() for p in pids]:
        wait_for(lambda pid=pid: not alive(pid), 5, f"pid {pid} to be gone")


def test_teacher_port_in_use_is_one_line(tmp_path, rl_env):
    import socket

    args = teacher_args()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(args[-1])))
        busy.listen()
        result = subprocess.run(rl_cmd(tmp_path / "run", *args), env=rl_env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "teacher.port" in result.stderr and "--teacher.port" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_the_last_process_to_finish_is_named_once(tmp_path, rl_env):
    """An orchestrator that outlives the trainer (its final eval): rl said `trainer finished` twice, the second time
    when the orchestrator had."""
    out = tmp_path / "run"
    env = {**rl_env, "FAKE_FINAL_EVAL_S": "1"}
    result = subprocess.run(rl_cmd(out), env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rl: ") and "finished" in line]
    assert lines == ["rl: trainer finished; waiting for the orchestrator to finish",
                     "rl: orchestrator finished; stopping the other processes"]  # fmt: skip
