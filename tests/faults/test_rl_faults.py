"""Faults of a real `rl` run (the reverse-text example on CPU, shortened, evals off; slow): SIGKILL and SIGSTOP of each
process at a random point after the first checkpoint, a weight update that never completes, a full disk under the
output directory, the inference port taken before start, and a kill between checkpoints. Each asserts the detection
time (within the liveness bound), the one-line cause on stderr, that no process is left, and that the run resumes
(`--resume`) to the same final step; the last one that the resumed steps sample and train as an uninterrupted run.

The random point is drawn from a seed printed with each test (``FAULT_SEED`` replays one)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from prime_core.schemas import read_microbatches

from tests.e2e.test_reverse_text import ROOT, _alive, _find, _process_tree, metrics, rl_cmd, run_rl, without_evals

# Two rl runs a test (the fault, then the resume): minutes each on a loaded 2-core host.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.xdist_group("multiprocess"),
    pytest.mark.timeout(2400),
]

SLACK_S = 15.0
MAX_STEPS = 6
SHORT = ("--orchestrator.batch-size", "16", "--ckpt.interval", "1", "--liveness.slack-s", str(SLACK_S))
# SIGKILL: an exit, seen within a poll. SIGSTOP: slack + a heartbeat and a check interval; the rest is a loaded host.
KILL_LIMIT_S = 10.0
STOP_LIMIT_S = SLACK_S + 10.0


def fault_rng(request) -> random.Random:
    seed = int(os.environ.get("FAULT_SEED", random.randrange(1 << 30)))
    print(f"{request.node.name}: FAULT_SEED={seed}")
    return random.Random(seed)


def start_run(out: Path, config: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = rl_cmd(out, "--max-steps", str(MAX_STEPS), *SHORT, *extra, config=config)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip


def wait_for_path(proc: subprocess.Popen, path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"rl ended before {path} appeared: {out[-2000:]}{err[-2000:]}")
        assert time.monotonic() < deadline, f"no {path} within {timeout} s"
        time.sleep(0.2)


def finish(proc: subprocess.Popen, since: float, timeout: float) -> tuple[str, str, float]:
    try:
        out, err = proc.communicate(timeout=timeout + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, err, time.monotonic() - since


def assert_nothing_left(tree: dict[int, list[str]]) -> None:
    for pid in tree:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
    time.sleep(0.5)
    left = {pid: tree[pid] for pid in tree if _alive(pid)}
    assert left == {}, left


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def resume_to_the_end(out: Path, config: Path) -> None:
    result = run_rl(out, "--max-steps", str(MAX_STEPS), *SHORT, "--resume", config=config)
    assert "rl: resuming from step" in result.stdout
    assert (out / "weights" / f"step_{MAX_STEPS}" / "STABLE").exists()
    assert sorted(metrics(out, "trainer", "loss/mean")) == list(range(MAX_STEPS))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("victim", ["trainer", "orchestrator", "inference"])
def test_each_process_killed_or_stopped_at_a_random_point(tmp_path, request, victim, sig):
    rng = fault_rng(request)
    out, config = tmp_path / "run", without_evals(tmp_path)
    proc = start_run(out, config)
    try:
        wait_for_path(proc, out / "checkpoints" / "step_1" / "STABLE")
        time.sleep(rng.uniform(0, 3))
        tree = _process_tree(proc.pid)
        os.kill(_find(tree, victim), sig)
        at = time.monotonic()
        out_text, err, took = finish(proc, at, KILL_LIMIT_S if sig == signal.SIGKILL else STOP_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    cause = one_line(err)
    name = signal.Signals(sig).name
    print(f"{name} {victim}: rl stopped {took:.1f} s later: {cause}")
    assert proc.returncode == 1
    if sig == signal.SIGKILL:
        assert took < KILL_LIMIT_S and cause.startswith(f"error: {victim} was killed by SIGKILL"), cause
    else:
        assert took < STOP_LIMIT_S and cause.startswith(f"error: {victim} is stuck: "), cause
        assert "stopped by a signal" in cause, cause
        if victim == "inference":  # found by its /health probe, each request bounded by liveness.probe_timeout_s
            assert "/health has not answered for" in cause, cause
    assert_nothing_left(tree)
    resume_to_the_end(out, config)


SITE_HANG = """
import os, sys
if os.path.basename(sys.argv[0]) == "inference":
    import asyncio
    from prime_inference.engines.torch_engine import TorchEngine
    _load = TorchEngine.update_weights

    async def update_weights(self, weight_dir, step):
        if step == int(os.environ["FAULT_HANG_UPDATE_AT"]):
            await asyncio.Event().wait()  # a load that never completes; the server keeps answering /health
        return await _load(self, weight_dir, step)

    TorchEngine.update_weights = update_weights
"""


def test_a_weight_update_that_never_completes(tmp_path):
    out, config = tmp_path / "run", without_evals(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_HANG)
    timeout = 20
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "FAULT_HANG_UPDATE_AT": "2"}  # fmt: skip
    proc = start_run(out, config, "--orchestrator.client.update-weights-timeout", str(timeout), env=env)
    try:
        wait_for_path(proc, out / "weights" / "step_2" / "STABLE")
        at = time.monotonic()
        _, err, took = finish(proc, at, timeout + STOP_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    cause = one_line(err)
    print(f"weight update hangs: rl stopped {took:.1f} s after weights step 2 appeared: {cause}")
    assert took < timeout + STOP_LIMIT_S
    assert cause.startswith("error: inference is stuck: orchestrator has been waiting for inference to load weights "
                            "step 2 (client.update_weights_timeout) for "), cause  # fmt: skip
    assert f"past its bound of {timeout} s + {SLACK_S:.0f} s slack" in cause
    resume_to_the_end(out, config)


SITE_LOSE = """
import os, sys
if os.path.basename(sys.argv[0]) == "orchestrator":
    from prime_core.transport import FilesystemSender
    _send = FilesystemSender.send

    def send(self, step, rank, meta, micro_batches):
        _send(self, step, rank, meta, micro_batches)
        if step == int(os.environ["FAULT_LOSE_ROLLOUTS_AT"]):
            self.run_dir.rollout_file(step, rank).unlink()  # gone before the trainer read it

    FilesystemSender.send = send
"""


def test_a_rollouts_file_lost_before_the_trainer_read_it(tmp_path):
    """Found by benchmarks/chaos.py (a rollouts file deleted): the trainer waited for it and the orchestrator for the
    next weights, each on the other with no bound; the run sat until the orchestrator's weights_timeout (1200 s).
    Now the watchdog names the pair within slack_s, and the run resumes."""
    out, config = tmp_path / "run", without_evals(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_LOSE)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "FAULT_LOSE_ROLLOUTS_AT": "2"}  # fmt: skip
    proc = start_run(out, config, env=env)
    try:
        wait_for_path(proc, out / "weights" / "step_2" / "STABLE")
        at = time.monotonic()
        _, err, took = finish(proc, at, STOP_LIMIT_S + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    cause = one_line(err)
    print(f"rollouts lost: rl stopped {took:.1f} s after weights step 2 appeared: {cause}")
    assert proc.returncode == 1 and took < STOP_LIMIT_S + 30, (took, cause)
    assert cause.startswith("error: trainer is stuck: trainer rank 0 has been waiting for the orchestrator's rollouts "
                            "of step 2 (rollouts/step_2/rank_0) while orchestrator has been waiting for the trainer's "
                            "weights step 3 ("), cause  # fmt: skip
    assert "each has waited only on the other for" in cause, cause
    resume_to_the_end(out, config)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
def test_a_full_disk_in_the_output_directory(tmp_path):
    out, config = tmp_path / "run", without_evals(tmp_path)
    out.mkdir()
    # Weights are 6.4 MB a step and a checkpoint about three times that: 60 MB fill up after a step or two.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(out)], check=True)
    try:
        proc = start_run(out, config)
        at = time.monotonic()
        out_text, err, took = finish(proc, at, 600)
        cause = one_line(err)
        print(f"full disk: rl stopped after {took:.1f} s: {cause}")
        assert proc.returncode == 1 and "No space left on device (errno 28 ENOSPC)" in cause, cause
        subprocess.run(["mount", "-o", "remount,size=400m", str(out)], check=True)
        resume_to_the_end(out, config)
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def test_the_inference_port_taken_before_start(tmp_path):
    out, config = tmp_path / "run", without_evals(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = rl_cmd(out, "--max-steps", "2", *SHORT, config=config)
        cmd[cmd.index("--inference.server.port") + 1] = str(port)
        start = time.monotonic()
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    cause = one_line(result.stderr)
    print(f"port taken: rl refused in {took:.1f} s: {cause}")
    assert result.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in cause
    assert not (out / "logs").exists(), "nothing started"
    run_rl(out, "--max-steps", "2", *SHORT, config=config)  # the port free again (another one): the run goes
    assert (out / "weights" / "step_2" / "STABLE").exists()


def test_a_kill_between_checkpoints_resumes_with_the_same_rollouts_and_losses(tmp_path):
    """Checkpoints every 2 steps; the trainer is killed once weights 3 exist (step 2 trained, not checkpointed). The
    resumed run starts at checkpoint 2 without the stopped run's rollouts and weights of later steps, so steps 2 and
    3 sample the same tokens and train to the same losses as an uninterrupted run (as the clean-stop resume test)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    config = without_evals(tmp_path)
    common = ("--max-steps", "4", "--orchestrator.batch-size", "32", "--ckpt.interval", "2")
    run_rl(straight, *common, config=config)
    proc = subprocess.Popen(rl_cmd(killed, *common, config=config), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for_path(proc, killed / "weights" / "step_3" / "STABLE")
        tree = _process_tree(proc.pid)
        os.kill(_find(tree, "trainer"), signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_nothing_left(tree)
    result = run_rl(killed, *common, "--resume", config=config)
    assert "rl: resuming from step 2" in result.stdout
    assert "removed the stopped run's rollouts of steps 2" in result.stdout, result.stdout
    assert "weights of steps 3" in result.stdout, result.stdout
    for step in (2, 3):
        _, want = read_microbatches(straight / "rollouts" / f"step_{step}" / "rank_0.safetensors")
        _, got = read_microbatches(killed / "rollouts" / f"step_{step}" / "rank_0.safetensors")
        for w, g in zip(want, got, strict=True):
            assert (w.input_ids == g.input_ids).all() and (w.loss_mask == g.loss_mask).all()
    want, got = metrics(straight, "trainer", "loss/mean"), metrics(killed, "trainer", "loss/mean")
    print(f"losses straight {want}, resumed after a kill {got}")
    for step in (2, 3):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), (want, got)


def with_env_workers(tmp_path: Path, num_workers: int) -> Path:
    config = without_evals(tmp_path)
    text = config.read_text().replace('id = "reverse-text"\n', f'id = "reverse-text"\nnum_workers = {num_workers}\n', 1)
    config.write_text(text)
    return config


def env_workers(tree: dict[int, list[str]]) -> list[int]:
    """Workers of an env server's pool: spawned children of the broker, which the orchestrator's forkserver forked
    (the broker's command line is the forkserver's)."""
    forked = {pid for pid, cmd in tree.items() if any("multiprocessing.forkserver" in c for c in cmd)}
    spawned = {pid for pid, cmd in tree.items() if any("spawn_main" in c for c in cmd)}
    parents = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in spawned}
    return sorted(pid for pid in spawned if parents[pid] in forked)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_an_env_worker_killed_or_stopped_is_replaced_and_the_run_finishes(tmp_path, request, sig):
    """Two env workers; one is killed or stopped at a random point after the first checkpoint. The orchestrator names
    it and replaces the env server within seconds, re-runs what it held, and rl finishes every step (exit 0)."""
    rng = fault_rng(request)
    out, config = tmp_path / "run", with_env_workers(tmp_path, 2)
    proc = start_run(out, config)
    try:
        wait_for_path(proc, out / "checkpoints" / "step_1" / "STABLE")
        time.sleep(rng.uniform(0, 3))
        tree = _process_tree(proc.pid)
        workers = env_workers(tree)
        assert len(workers) == 2, tree
        os.kill(workers[0], sig)
        at, log, line = time.monotonic(), out / "logs" / "orchestrator.log", None
        while line is None and time.monotonic() - at < 60:
            found = [x for x in log.read_text().splitlines() if f"{workers[0]}" in x and "restarting the server" in x
                     or f"pid {workers[0]} (" in x and "replacing the server" in x]  # fmt: skip
            line = found[0] if found else None
            time.sleep(0.2)
        took = time.monotonic() - at
        out_text, err, _ = finish(proc, at, 900)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{signal.Signals(sig).name} env worker: found after {took:.1f} s: {line}")
    assert line is not None and took < 10, (took, line)
    assert proc.returncode == 0, out_text[-2000:] + err[-2000:]
    assert sorted(metrics(out, "trainer", "loss/mean")) == list(range(MAX_STEPS))
    assert max(metrics(out, "orchestrator", "env_servers/reverse-text/restarts").values()) >= 1
    assert_nothing_left(tree)
