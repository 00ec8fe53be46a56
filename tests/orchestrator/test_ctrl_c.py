"""Ctrl-C of an ``orchestrator`` started on its own: exit 130 and one line saying what stopped and where it stood (the
step, the rollouts in flight, the steps shipped, the checkpoint to resume from), as ``trainer``, ``sft`` and ``eval``
say theirs. Before, it exited 130 without a word."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prime_core import progress
from prime_core.io import mark_stable
from prime_core.run_dir import RunDir
from prime_orchestrator.batch import ShippedSteps


class Interrupted:
    """A run that ships steps 0-1, has 3 of 8 rollouts of step 2 done, and is then sent SIGINT ``times`` times (the
    later ones while it closes, as a second Ctrl-C comes)."""

    def __init__(self, times: int = 1):
        self.shipped = ShippedSteps(count=2, last=1)
        self.config = SimpleNamespace(ckpt=SimpleNamespace(interval=1))
        self.times = times
        self.closed = False

    async def run(self) -> None:
        progress.set_step(2)
        progress.begin("generating rollouts (3 of 8 done for step 2)", lane="rollouts")
        try:
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(30)
        finally:
            progress.end("rollouts")  # as a cancelled rollout's ``finally`` clears its lane
            for _ in range(self.times - 1):
                signal.raise_signal(signal.SIGINT)
                await asyncio.sleep(0.5)
            self.closed = True


@pytest.fixture(autouse=True)
def own_progress(monkeypatch):
    """A progress record of this test's own (another test's lanes must not show in the line), and Python's SIGINT
    handler, as an entry point starts with (a test before, in this process, may have left another: `watch_forever`)."""
    monkeypatch.setattr(progress, "_current", progress.ProgressReporter(None, "orchestrator"))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_says_where_the_orchestrator_stood(tmp_path, capsys):
    from prime_orchestrator.entrypoints.orchestrator import run
    from prime_orchestrator.interrupt import Interrupts

    run_dir = RunDir(tmp_path)
    for step in (1, 2):  # step 2's orchestrator part never finished: not one to resume from
        run_dir.orchestrator_checkpoint(step).mkdir(parents=True)
    mark_stable(run_dir.orchestrator_checkpoint(1))
    orchestrator = Interrupted()
    with pytest.raises(SystemExit) as e:
        run(orchestrator, tmp_path)
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "orchestrator: interrupted (SIGINT) at step 2 (generating rollouts (3 of 8 done for step 2)); shipped steps "
        "0-1 to the trainer; resume from its newest checkpoint with --ckpt.resume-step 1\n"
    )
    assert orchestrator.closed
    # A second Ctrl-C from here on (the exit's joins) ends the process at once (``Interrupts.end_now``).
    assert getattr(signal.getsignal(signal.SIGINT), "__func__", None) is Interrupts.end_now


class SlowClose(Interrupted):
    """``Interrupted`` whose close takes 20 s (``how``: an env server's stop in a thread, or a child process the exit
    joins), and a second Ctrl-C 0.5 s into it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    async def run(self) -> None:
        import multiprocessing
        import threading

        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(20,))
        try:
            await super().run()
        finally:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            if self.how == "thread":
                await asyncio.to_thread(time.sleep, 20)
            else:
                child.start()  # not joined: multiprocessing's exit handler joins it


@pytest.mark.parametrize("how", ["thread", "child"])
def test_a_second_ctrl_c_while_the_orchestrator_stops_ends_it_at_once_in_one_line(tmp_path, how):
    """Before, the second Ctrl-C raised ``KeyboardInterrupt`` where the close stood: a thread still running held the
    exit until it ended (20 s), and one in the exit's join of a child printed a traceback after the line."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys; from pathlib import Path; from prime_orchestrator.entrypoints.orchestrator import run; "
            "from tests.orchestrator.test_ctrl_c import SlowClose; run(SlowClose(sys.argv[1]), Path(sys.argv[2]))")  # fmt: skip
    err = tmp_path / "stderr"
    began = time.monotonic()
    with err.open("w") as f:  # a file, not a pipe: the child process holds a pipe open past the exit
        proc = subprocess.Popen([sys.executable, "-c", code, how, str(tmp_path)], cwd=root, stderr=f,
                                start_new_session=True)  # fmt: skip
    try:
        returncode = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the child process the exit was joining
    took = time.monotonic() - began
    print(f"{how}: exit {returncode} after {took:.1f} s")
    assert returncode == 130 and took < 10, (returncode, took, err.read_text())
    assert err.read_text().splitlines() == [
        "orchestrator: interrupted (SIGINT) at step 2 (generating rollouts (3 of 8 done for step 2)); shipped steps "
        "0-1 to the trainer; it saved no checkpoint to resume from"
    ], err.read_text()


def test_ctrl_c_before_the_first_step_says_so(tmp_path):
    from prime_orchestrator.interrupt import interrupted_line

    assert interrupted_line(None, ShippedSteps(), tmp_path, None) == (
        "orchestrator: interrupted (SIGINT) before its first step; shipped no step to the trainer; it saved no "
        "checkpoint to resume from (ckpt.interval is unset)"
    )


def test_the_steps_shipped_are_two_numbers_however_long_the_run(tmp_path):
    """``Orchestrator.shipped`` kept every step shipped, for the Ctrl-C line's span and the final count: one int a step
    for the whole run (100,000 steps: 3.6 MB in memory, 369 kB pickled; now 89 bytes). The steps ship one after
    another: their count and the last say the same line."""
    import pickle

    from prime_orchestrator.interrupt import interrupted
    from prime_orchestrator.orchestrator import Orchestrator

    from tests.orchestrator.test_curriculum import config

    orch = Orchestrator(config(tmp_path))
    # What ``ship`` notes of each step (before: append).
    ship = getattr(orch.shipped, "add", None) or orch.shipped.append
    for step in range(5, 100_005):  # a run resumed at step 5
        ship(step)
    size = len(pickle.dumps(orch.shipped))
    assert size < 200, size
    assert "; shipped steps 5-100004 to the trainer; " in interrupted(orch, [], tmp_path)
    one = Orchestrator(config(tmp_path))
    (getattr(one.shipped, "add", None) or one.shipped.append)(7)
    assert "; shipped step 7 to the trainer; " in interrupted(one, [], tmp_path)


def test_a_forkserver_interrupted_while_it_imports_ends_without_a_word():
    """The env servers' forkserver imports ``forkserver_signals`` first: a Ctrl-C during the seconds of imports after
    it ends it (128 + SIGINT) silently; before, 30 lines of KeyboardInterrupt traceback."""
    import subprocess
    import sys

    code = "import os, signal, time, prime_orchestrator.forkserver_signals; os.kill(os.getpid(), signal.SIGINT); " + (
        "time.sleep(5)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stderr) == (130, "")


@pytest.mark.slow
def test_ctrl_c_of_the_terminal_while_env_servers_start_is_one_line(tmp_path):
    """The terminal's Ctrl-C reaches the process group (orchestrator, forkserver, env servers) while the env servers
    start: exit 130 and the orchestrator's one line, within seconds. Before: exit 130 without a word, or exit 1 with an
    EOFError traceback (the forkserver, killed while it imported, printed its own), and up to 14 s."""
    from tests.tiny import free_port

    root = Path(__file__).resolve().parents[2]
    rl = [str(Path(sys.executable).parent / "rl"), "@", str(root / "examples/reverse_text/rl.toml")]
    subprocess.run([*rl, "--output-dir", str(tmp_path), "--dry-run"], check=True, capture_output=True, timeout=120)
    cmd = [str(Path(sys.executable).parent / "orchestrator"), "@", str(tmp_path / "configs" / "orchestrator.toml"),
           "--client.base-urls", f"http://127.0.0.1:{free_port()}", "--log.file", "false"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _forkserver_in(proc.pid):  # the env servers begin to start
        time.sleep(0.1)
    time.sleep(1.0)  # the forkserver is importing PRELOAD
    os.killpg(proc.pid, signal.SIGINT)
    began = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - began
    assert proc.returncode == 130 and took < 8, (proc.returncode, took, err)
    assert err.strip().splitlines() == [
        "orchestrator: interrupted (SIGINT) before its first step (starting env servers and waiting for inference's "
        "/health); shipped no step to the trainer; it saved no checkpoint to resume from (ckpt.interval is unset)"
    ], err


def _forkserver_in(session: int) -> bool:
    """Whether a forkserver runs in the session ``session``."""
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and os.getsid(int(proc.name)) == session
                and b"forkserver" in (proc / "cmdline").read_bytes()
            ):
                return True
        except OSError:
            continue
    return False


class LeavesADaemon:
    """A run whose env server (a stand-in: a cgroup of its own and a token, as ``EnvServer.start`` makes them) left a
    daemon (``how``: ``cgroup``, ``env -i sleep 3599 &`` that only the cgroup finds; ``token``, a marked one where no
    cgroup is, found by the token search; ``forks``, a cgroup's daemon that forks again and again and ignores SIGTERM),
    then stops slowly: the test sends the Ctrl-Cs, the second while the close blocks (``pids`` says when)."""

    def __init__(self, how: str, pids: Path):
        self.how, self.pids = how, pids

    async def run(self) -> None:
        import threading

        from prime_orchestrator import server_cgroup
        from prime_orchestrator.proc_tree import MARK_VAR

        token = f"test-fast-exit-{os.getpid()}"
        cgroup = server_cgroup.own_cgroup(token)
        if self.how == "token" and cgroup is not None:  # gone (as where no cgroup v2 is writable): the token finds it
            server_cgroup.kill_members(Path(cgroup))
            cgroup = None
        daemon = {"forks": "trap '' TERM; while :; do sleep 3599 & sleep 0.05; done"}.get(self.how, "sleep 3599")
        join = f"from prime_orchestrator.server_cgroup import join; join({cgroup!r}); " if cgroup else ""
        program = (f"{join}import subprocess as s; print(s.run(['sh', '-c', {daemon!r} + ' </dev/null >/dev/null 2>&1 "
                   "& echo $!'], env={} if %r else {'%s': %r}, capture_output=True, text=True).stdout)"
                   % (cgroup is not None, MARK_VAR, token))  # fmt: skip
        out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        self.pids.write_text(f"{out.stdout.strip()} {cgroup or ''}\n")
        try:
            await asyncio.sleep(60)  # the first Ctrl-C
        finally:
            self.pids.write_text(self.pids.read_text() + "closing\n")
            await asyncio.to_thread(threading.Event().wait, 30)  # an env server's stop that blocks; the second Ctrl-C


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize(("how", "ctrl_cs"), [("cgroup", 2), ("token", 2), ("forks", 3)])
def test_a_second_ctrl_c_still_kills_what_the_env_servers_left(tmp_path, how, ctrl_cs):
    """The fast exit (``Interrupts.end_now``) skipped the env servers' stop, and with it the kill of their cgroups and
    of the programs carrying their token: a reward's daemon outlived the orchestrator. Now every env server not yet
    stopped has its cgroup killed (or its token searched) before the exit, within a bound."""
    root = Path(__file__).resolve().parents[2]
    pids = tmp_path / "pids"
    code = ("import signal, sys; from pathlib import Path; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from prime_orchestrator.entrypoints.orchestrator import run; from tests.orchestrator.test_ctrl_c import "
            "LeavesADaemon; run(LeavesADaemon(sys.argv[1], Path(sys.argv[2])), Path(sys.argv[3]))")  # fmt: skip
    err = tmp_path / "stderr"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code, how, str(pids), str(tmp_path)], cwd=root, stderr=f)
    daemon, cgroup = None, ""
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon, _, cgroup = pids.read_text().split("\n")[0].partition(" ")
        daemon = int(daemon)
        if how != "token" and not cgroup:
            pytest.skip("no writable cgroup v2 here")
        assert not _gone(daemon), err.read_text()
        proc.send_signal(signal.SIGINT)
        while "closing" not in pids.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.monotonic()
        for _ in range(ctrl_cs - 1):
            proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=60)
        print(f"{how}: exit {returncode} {time.monotonic() - began:.3f} s after the second Ctrl-C")
        assert returncode == 130, err.read_text()
        assert _gone(daemon), f"the daemon {daemon} outlived the orchestrator"
        assert not cgroup or not os.path.exists(cgroup)  # emptied (what the daemon forked meanwhile too), removed
    finally:
        proc.kill()
        if isinstance(daemon, int) and not _gone(daemon):
            os.kill(daemon, signal.SIGKILL)
        if cgroup and os.path.exists(cgroup):
            from prime_orchestrator.server_cgroup import kill_members

            kill_members(Path(cgroup))
