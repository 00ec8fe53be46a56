"""The watchdog's rules on synthetic progress files and servers (the end-to-end cases: tests/faults/), and the
rewind of a run directory before a resume."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prime_core.config.liveness import LivenessConfig
from prime_core.io import atomic_dir, mark_stable
from prime_core.progress import read_progress
from prime_core.run_dir import RunDir
from prime_core.schemas.progress import Activity, Progress
from prime_launch.process import tail_lines
from prime_launch.resume import rewind
from prime_launch.watchdog import ProcessStuck, Watchdog


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(path, **fields):
    record = {"process": "trainer", "pid": 1, "started": 990.0, "time": 1000.0, "run_id": "run", **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(Progress.model_validate(record).model_dump_json())


def watchdog(tmp_path, clock, **config):
    dog = Watchdog(LivenessConfig(slack_s=10, **config), run_id="run", clock=clock)
    dog.watch("trainer", [tmp_path / "t.json"], tmp_path / "trainer.log")
    dog.watch("orchestrator", [tmp_path / "o.json"], tmp_path / "orchestrator.log")
    return dog


def check(dog, clock, at):
    clock.now = at
    dog._last_check = 0.0
    dog.check()


def test_heartbeat_age_and_startup_allowance(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, clock, startup_s=30)
    write(tmp_path / "o.json", process="orchestrator", time=1019.0)
    check(dog, clock, 1020.0)  # the trainer has not written yet, within its 30 s
    write(tmp_path / "t.json", time=1020.0)
    write(tmp_path / "o.json", process="orchestrator", time=1020.0)
    check(dog, clock, 1029.0)
    with pytest.raises(ProcessStuck, match=r"trainer sent no heartbeat for 11 s \(pid 1.*\); it was idle"):
        check(dog, clock, 1031.0)


def test_files_of_an_earlier_launch_or_another_run_are_ignored(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, clock, startup_s=5)
    write(tmp_path / "t.json", time=900.0)  # left by the run that was stopped
    write(tmp_path / "o.json", process="orchestrator", time=1001.0, run_id="another")
    with pytest.raises(ProcessStuck, match="trainer is stuck: it wrote no heartbeat to .* in the 6 s since it started"):
        check(dog, clock, 1006.0)


def test_a_fifo_or_an_enormous_file_where_a_heartbeat_goes_is_no_heartbeat(tmp_path):
    """Before: the watchdog opened a FIFO at a process's progress path and waited in ``open`` for a writer forever (rl
    hung; no process was watched any more). Now it reads no record there, and names the process by its startup
    allowance; an enormous file is not read whole every second either."""
    clock = Clock()
    dog = watchdog(tmp_path, clock, startup_s=5)
    os.mkfifo(tmp_path / "t.json")
    with open(tmp_path / "o.json", "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB of zeros
    caught: list[BaseException] = []

    def run() -> None:
        try:
            check(dog, clock, 1006.0)
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            caught.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        with open(tmp_path / "t.json", "wb"):  # lets the blocked open return, so the thread ends
            pass
        raise AssertionError("the watchdog blocked on a FIFO at a progress path")
    assert len(caught) == 1 and isinstance(caught[0], ProcessStuck), caught
    assert "it wrote no heartbeat to" in str(caught[0]), caught[0]
    assert read_progress(tmp_path / "o.json") is None
    assert tail_lines(tmp_path / "t.json", 5) == []  # a log there: its tail is not waited for either


def test_bounds_limit_learned_first_and_waits(tmp_path):
    dog = Watchdog(LivenessConfig(learned_factor=4, learned_floor_s=60, first_timeout_s=1800))
    record = Progress(process="trainer", pid=1, started=0, time=0, slowest_s={"step": 20.0, "publish": 1.0})

    def bound(**a):
        return dog.bound(record, Activity(what="x", since=0, **a))

    assert bound(kind="step") == 80 and bound(kind="publish") == 60 and bound(kind="checkpoint") == 1800
    assert bound(limit_s=5, waits_for="inference") == 5
    assert bound(waits_for="orchestrator") is None and bound() is None
    fixed = Watchdog(LivenessConfig(step_timeout_s=7))
    assert fixed.bound(record, Activity(what="x", since=0, kind="checkpoint")) == 7


def test_an_overdue_wait_blames_the_process_waited_for(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, clock)
    dog.watch("inference", [], tmp_path / "inference.log")
    relay = Activity(lane="relay", what="waiting for inference to load weights step 2", since=1000.0, limit_s=20,
                     waits_for="inference")  # fmt: skip
    policy = Activity(lane="policy", what="waiting for the trainer's weights step 3", since=900.0, waits_for="trainer")
    write(
        tmp_path / "o.json", process="orchestrator", time=1031.0, activities=[relay.model_dump(), policy.model_dump()]
    )
    write(tmp_path / "t.json", time=1031.0)
    check(dog, clock, 1029.0)
    with pytest.raises(ProcessStuck) as stuck:
        check(dog, clock, 1031.0)
    assert stuck.value.cause == (
        "inference is stuck: orchestrator has been waiting for inference to load weights step 2 for 31 s, past its "
        f"bound of 20 s + 10 s slack (log: {tmp_path / 'inference.log'})"
    )


def test_trainer_and_orchestrator_waiting_on_each_other_are_named(tmp_path):
    """A rollouts file deleted before the trainer read it (benchmarks/chaos.py): the trainer waits for it, the
    orchestrator, having shipped it, for the next weights. Before, neither wait had a bound of its own and the run sat
    until the orchestrator's weights_timeout (1200 s: `is the trainer running?`). Now the pair is named once the
    watchdog has seen both wait only on each other for slack_s in a row. The orchestrator begins its wait for the next
    weights while it still ships (a healthy run, where each wait had lasted past the slack when the ship ended: the
    first version of this rule stopped it), and a wait that moves on starts the count again."""
    clock = Clock()
    dog = watchdog(tmp_path, clock)
    rollouts = Activity(what="waiting for the orchestrator's rollouts of step 3 (rollouts/step_3/rank_0)", since=1000.0,
                        waits_for="orchestrator")  # fmt: skip
    weights = Activity(
        lane="policy", what="waiting for the trainer's weights step 4", since=1005.0, waits_for="trainer"
    )
    ship = Activity(lane="ship", what="packing and sending step 3", since=1005.0, kind="ship")

    def at(now, trainer=rollouts, orchestrator=(weights,)):
        write(tmp_path / "t.json", rank=0, step=3, time=now, activities=[trainer.model_dump()])
        write(tmp_path / "o.json", process="orchestrator", step=4, time=now,
              activities=[a.model_dump() for a in orchestrator])  # fmt: skip
        check(dog, clock, now)

    at(1030.0, orchestrator=(weights, ship))  # the orchestrator still ships: the trainer may yet get its file
    at(1031.0)  # each wait is past the slack, but the cycle is new
    at(1041.0)
    at(1042.0, trainer=rollouts.model_copy(update={"what": "waiting (step 4)"}))  # a new pair of waits
    at(1043.0)
    at(1053.0)
    write(tmp_path / "t.json", rank=0, step=3, time=1054.0, activities=[rollouts.model_dump()])
    write(tmp_path / "o.json", process="orchestrator", step=4, time=1054.0, activities=[weights.model_dump()])
    with pytest.raises(ProcessStuck) as stuck:
        check(dog, clock, 1054.0)
    assert stuck.value.cause == (
        "trainer is stuck: trainer rank 0 has been waiting for the orchestrator's rollouts of step 3 "
        "(rollouts/step_3/rank_0) while orchestrator has been waiting for the trainer's weights step 4: each has "
        "waited only on the other for 11 s, so what one handed the other was lost (a file deleted or not visible on "
        f"this file system, or a message dropped) (log: {tmp_path / 'trainer.log'})"
    )


def test_a_progress_file_gone_for_a_moment_is_no_silence(tmp_path):
    """benchmarks/chaos.py deleted progress/inference.json (rewritten within a second): one check that found it missing
    stopped the run with `it wrote no heartbeat ... in the 85 s since it started`. Now the last record read ages on:
    a file back within the slack is no fault, one that stays away is named by its last heartbeat."""
    clock = Clock()
    dog = watchdog(tmp_path, clock, startup_s=5)
    for at in (1000.0, 1010.0):
        write(tmp_path / "t.json", time=at)
        write(tmp_path / "o.json", process="orchestrator", time=at)
        check(dog, clock, at)
    (tmp_path / "t.json").unlink()
    check(dog, clock, 1011.0)
    (tmp_path / "t.json").write_text("{not json")
    check(dog, clock, 1012.0)
    write(tmp_path / "o.json", process="orchestrator", time=1021.0)
    with pytest.raises(ProcessStuck, match=r"trainer is stuck: trainer sent no heartbeat for 11 s \(pid 1"):
        check(dog, clock, 1021.0)


def test_exiting_processes_must_go_and_finished_ones_are_left_alone(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, clock)
    write(tmp_path / "t.json", time=1000.0, exiting=True)
    write(tmp_path / "o.json", process="orchestrator", time=1011.0)
    clock.now = 1011.0
    dog.check(finished=["trainer"])
    with pytest.raises(ProcessStuck, match="trainer finished its work 11 s ago but has not exited"):
        check(dog, clock, 1011.0)


def pool_watchdog(tmp_path, clock, what: str) -> tuple[Watchdog, dict]:
    """A watchdog of a healthy trainer and orchestrator that reads sandbox pools' files under progress/, and a pool's
    activity ``what`` since 1000 s with a bound of 20 s."""
    dog = watchdog(tmp_path, clock)
    dog.watch_helpers(tmp_path / "progress")
    write(tmp_path / "t.json", time=1040.0)
    write(tmp_path / "o.json", process="orchestrator", time=1040.0)
    return dog, Activity(lane="executions", what=what, since=1000.0, limit_s=20).model_dump()


def test_a_live_sandbox_pool_past_its_bound_is_named_and_gone_ones_are_not(tmp_path):
    clock = Clock()
    dog, running = pool_watchdog(tmp_path, clock, "running 2 sandbox execution(s)")
    pool = {"process": "sandbox_pool", "pid": 7, "host": "node-2", "activities": [running],
            "counters": {"executions_completed": 40, "zygotes_replaced": 1}}  # fmt: skip
    write(tmp_path / "progress" / "sandbox_pool_7.json", **pool, time=1040.0)
    write(tmp_path / "progress" / "sandbox_pool_8.json", **{**pool, "pid": 8}, time=1020.0)  # gone (replaced)
    write(tmp_path / "progress" / "sandbox_pool_9.json", **{**pool, "pid": 9}, time=1040.0, run_id="another")
    check(dog, clock, 1030.0)  # within its bound and the slack
    with pytest.raises(ProcessStuck) as stuck:
        check(dog, clock, 1040.0)
    assert stuck.value.cause == (
        "sandbox pool is stuck: the sandbox pool (pid 7 on node-2) has been running 2 sandbox execution(s) for 40 s without one "
        "finishing, past its bound of 20 s + 10 s slack (40 executions completed, 1 zygotes replaced) "
        f"(log: {tmp_path / 'orchestrator.log'})"
    )


def test_pool_files_of_another_run_or_of_a_gone_process_are_not_a_fault(tmp_path):
    """progress/ of a run directory held an earlier run's ``sandbox_pool_<pid>.json``: one written without a run id
    (a process started without PRIME_RUN_ID), or one of a process on this host that has exited (an env server just
    replaced: its last record stays fresh for the slack) was read as this run's stuck pool."""
    clock = Clock()
    dog, running = pool_watchdog(tmp_path, clock, "running 1 sandbox execution(s)")
    gone = subprocess.Popen(["true"])
    gone.wait()
    pool = {"process": "sandbox_pool", "activities": [running], "time": 1040.0, "host": socket.gethostname()}
    write(tmp_path / "progress" / "sandbox_pool_1.json", **{**pool, "pid": 1, "host": "node-2"}, run_id=None)
    write(tmp_path / "progress" / f"sandbox_pool_{gone.pid}.json", **pool, pid=gone.pid)
    check(dog, clock, 1040.0)
    write(tmp_path / "progress" / f"sandbox_pool_{os.getpid()}.json", **pool, pid=os.getpid())
    with pytest.raises(ProcessStuck, match=rf"the sandbox pool \(pid {os.getpid()}, \w+\) has been running 1"):
        check(dog, clock, 1040.0)


def test_overwrite_clears_an_earlier_runs_progress_files(tmp_path):
    from prime_core.run_dir import clear_run

    run = RunDir(tmp_path)
    write(run.progress / "sandbox_pool_123.json", process="sandbox_pool", pid=123)
    write(run.progress_file("orchestrator"), process="orchestrator")
    (tmp_path / "notes.txt").write_text("mine")
    clear_run(run)
    assert not run.progress.exists() and (tmp_path / "notes.txt").read_text() == "mine"


class _Server:
    """A /health that answers with ``state`` until ``hang`` is set, then never answers."""

    def __init__(self, state):
        self.state, self.hang = state, threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                while outer.hang.is_set():
                    time.sleep(0.05)
                body = json.dumps(outer.state).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/health"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.hang.clear()
        self.httpd.shutdown()


def test_health_probe_finds_a_silent_server_and_a_stalled_engine():
    server = _Server({"status": "ok", "weight_step": 2, "running": 3, "engine_steps": 10})
    dog = Watchdog(LivenessConfig(slack_s=1.5, probe_timeout_s=0.5))
    try:
        dog.probe([server.url], None)
        probe = dog.probes[server.url]
        deadline = time.monotonic() + 20
        while probe.answer is None and time.monotonic() < deadline:
            time.sleep(0.05)
        dog._last_check = 0.0
        dog.check()  # it answers, and its engine just stepped
        time.sleep(2.5)  # 3 requests running, no step since
        dog._last_check = 0.0
        with pytest.raises(ProcessStuck, match="its engine made no step for [0-9]+ s with 3 requests running"):
            dog.check()
        server.state["running"] = 0  # idle: no step is expected
        time.sleep(1.2)
        dog._last_check = 0.0
        dog.check()
        server.hang.set()
        time.sleep(2.5)
        dog._last_check = 0.0
        with pytest.raises(ProcessStuck, match=r"has not answered for [0-9]+ s \(the last request has waited"):
            dog.check()
    finally:
        dog.close()
        server.close()


def test_rewind_removes_what_the_stopped_run_made_after_the_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    for step in range(5):
        with atomic_dir(run.weight_step(step)):
            pass
        run.rollout_step(step).mkdir(parents=True)
    note = rewind(run, 2)
    assert sorted(p.name for p in run.rollouts.iterdir()) == ["step_0", "step_1"]
    assert sorted(p.name for p in run.weights.iterdir()) == ["step_0", "step_1", "step_2"]
    assert note == f"removed the stopped run's rollouts of steps 2-4 and weights of steps 3-4 in {tmp_path} " \
        "(resuming from step 2 makes them again)"  # fmt: skip
    assert rewind(run, 2) is None


def test_only_complete_checkpoints_are_resumable(tmp_path):
    run = RunDir(tmp_path)
    for step in (2, 4, 6):
        run.trainer_checkpoint(step).mkdir(parents=True)
        mark_stable(run.trainer_checkpoint(step))
        mark_stable(run.checkpoint_step(step))
    for step in (2, 4):  # step 6: the orchestrator's part never came
        run.orchestrator_checkpoint(step).mkdir(parents=True)
        mark_stable(run.orchestrator_checkpoint(step))
    for step in (2, 6):  # step 4: its weights are gone
        run.weight_step(step).mkdir(parents=True)
        mark_stable(run.weight_step(step))
    assert run.checkpoint_steps() == [2, 4, 6] and run.resumable_steps() == [2]


CLI = [sys.executable, "-m", "prime_launch.entrypoints.cli"]


def test_prime_launch_watch_names_the_stuck_process_and_exits_1(tmp_path):
    """The watchdog of a multi-node SLURM job: heartbeats in the shared output directory, exit 1 with one line."""
    from prime_core.progress import ProgressReporter

    run = RunDir(tmp_path)
    beating = ProgressReporter(run.progress_file("orchestrator"), "orchestrator", run_id="job-7").start()
    try:
        args = ["watch", "--output-dir", str(tmp_path), "--trainer-ranks", "2", "--liveness.slack-s", "2",
                "--liveness.startup-s", "3"]  # fmt: skip
        env = {**os.environ, "PRIME_RUN_ID": "job-7"}
        proc = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # rank 0 beats (started after the watcher), rank 1 never does
        rank0 = ProgressReporter(run.progress_file("trainer", 0), "trainer", rank=0, run_id="job-7").start()
        out, err = proc.communicate(timeout=60)
        rank0.close()
    finally:
        beating.close()
    assert proc.returncode == 1 and out.startswith("watching orchestrator, trainer and 0 inference server(s)")
    assert err.startswith(f"error: trainer is stuck: it wrote no heartbeat to {run.progress_file('trainer', 1)}"), err
    assert err.count("\n") == 1


def test_prime_launch_watch_ends_cleanly_on_sigterm_and_rewind_cli(tmp_path):
    proc = subprocess.Popen([*CLI, "watch", "--output-dir", str(tmp_path), "--trainer-ranks", "0", "--orchestrator",
                             "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    # Its first line comes once it handles SIGTERM (a fixed 2 s sleep lost the race on a loaded host: exit -15).
    assert proc.stdout.readline().startswith("watching ")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    run = RunDir(tmp_path)
    run.rollout_step(3).mkdir(parents=True)
    run.checkpoint_step(2).mkdir(parents=True)
    mark_stable(run.checkpoint_step(2))
    done = subprocess.run(
        [*CLI, "rewind", "--output-dir", str(tmp_path), "--step", "2"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "removed the stopped run's rollouts of steps 3" in done.stdout
    assert not run.rollout_step(3).exists()


def test_a_process_stopped_before_its_first_heartbeat_is_named_as_stopped(tmp_path):
    """benchmarks/chaos.py stopped a trainer rank before its first heartbeat: the line said only that it `wrote no
    heartbeat ... since it started`. The watchdog knows the pid it started (a trainer's launcher, whose ranks are its
    children) and now says which process under it is stopped."""
    code = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    rank = None
    try:
        rank = int(launcher.stdout.readline())
        os.kill(rank, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child did not stop"
            time.sleep(0.01)
        clock = Clock()
        dog = Watchdog(LivenessConfig(slack_s=10, startup_s=5), run_id="run", clock=clock)
        dog.watch("trainer", [tmp_path / "t.json"], tmp_path / "trainer.log", pid=launcher.pid)
        with pytest.raises(ProcessStuck, match=rf"since it started \(pid {rank} stopped by a signal\)"):
            check(dog, clock, 1006.0)
    finally:
        for pid in (rank, launcher.pid):
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
