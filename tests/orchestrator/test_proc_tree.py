"""What an env server's close kills of the processes it leaves: only live ones (``proc_tree.kill_left``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prime_orchestrator.proc_tree import kill_left, snapshot

# A parent whose child dies with it (PR_SET_PDEATHSIG, as arithmetic's math-verify scorer): the child then stays a
# zombie until whoever adopted it reaps it.
PARENT = """
import ctypes, os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))
print(child.pid, flush=True)
time.sleep(60)
"""


def _state(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_child_that_died_with_its_server_is_not_reported_as_left_behind():
    """An eval of arithmetic warned on every normal close `env server arithmetic left processes [...] behind; killed
    them`: its scorer had died with the server and was a zombie, which still has its pid and start time."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    processes = snapshot(parent.pid)
    assert set(processes) == {parent.pid, child}
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert kill_left(processes, grace_s=5.0) == []
    assert _state(child) in (None, "Z")


def test_a_process_that_stays_is_killed_after_the_grace():
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        assert kill_left(snapshot(stays.pid), grace_s=0.3) == [stays.pid]
        assert time.monotonic() - t0 >= 0.3
        assert stays.wait(10) == -signal.SIGKILL
    finally:
        stays.kill()


def test_a_daemon_that_left_the_tree_is_found_by_the_mark_in_its_environment():
    """A program an env server started that left its tree (``cmd &`` in a shell that exited: init adopted it) is
    found by the mark every program of that server inherits; another server's programs are not."""
    from prime_orchestrator.proc_tree import MARK_VAR, kill_left, marked, process_tree

    quiet = "stdin=s.DEVNULL, stdout=s.DEVNULL, stderr=s.DEVNULL"  # the pipes run() reads would wait for it
    daemon = f"import subprocess as s; print(s.Popen(['sleep', '30'], start_new_session=True, {quiet}).pid)"
    env = {**os.environ, MARK_VAR: "test-mark"}
    out = subprocess.run([sys.executable, "-c", daemon], env=env, capture_output=True, text=True, timeout=60)
    pid = int(out.stdout)
    try:
        assert pid not in process_tree(os.getpid())  # its parent exited: not in this tree
        found = marked("test-mark")
        assert pid in found and marked("another-mark") == {}
        assert kill_left(found) == [pid]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_daemon_started_with_a_cleared_environment_is_killed_at_its_servers_stop(caplog):
    """``env -i sleep 3599 &`` carries no mark: the mark search missed it and it outlived its server (init adopted
    it). The server's own cgroup holds it, whatever its environment: it is killed at the server's stop."""
    import asyncio
    import logging

    import pytest
    from prime_core.schemas.rollout import EnvServerSpec
    from prime_orchestrator.env_server import EnvServer
    from prime_orchestrator.server_cgroup import own_cgroup

    server = EnvServer(EnvServerSpec(name="vf-daemon", env_config={}))
    server._mark = "test-mark-cleared"
    server._cgroup = own_cgroup(server._mark)
    if server._cgroup is None:
        pytest.skip("no writable cgroup v2 here (the mark search alone runs)")
    # What a server's reward does: in its cgroup (the server joins it first thing), a shell leaves a daemon that
    # carries nothing of the server's environment, and exits.
    program = (f"from prime_orchestrator.server_cgroup import join; import subprocess as s; join({server._cgroup!r}); "
               "print(s.run(['sh', '-c', 'env -i sleep 3599 </dev/null >/dev/null 2>&1 & echo $!'], env={}, "
               "capture_output=True, text=True).stdout)")  # fmt: skip
    env = {**os.environ, "PRIME_ENV_SERVER": server._mark}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    pid, cgroup = int(out.stdout), server._cgroup
    try:
        assert _state(pid) not in (None, "Z") and b"PRIME_ENV_SERVER" not in Path(f"/proc/{pid}/environ").read_bytes()
        with caplog.at_level(logging.WARNING, logger="prime.orchestrator.env"):
            asyncio.run(server._stop())
        assert _state(pid) in (None, "Z")  # killed (a zombie until init reaps it)
        assert f"env server vf-daemon left processes outside its tree (daemons): {pid} (sleep 3599)" in caplog.text
        assert not os.path.exists(cgroup)  # removed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_sandbox_pool_in_an_env_servers_cgroup_counts_the_parent_as_its_own():
    """A v2 cgroup holding processes cannot delegate controllers to children: a pool that made its cgroups below the
    env server's would lose its memory and pids limits (on a v2-only host, where it used the root's before)."""
    import pytest
    from prime_orchestrator.server_cgroup import create, kill_members

    path, why = create("test-pool")
    if path is None:
        pytest.skip(why)
    code = ("from prime_orchestrator.server_cgroup import join; from prime_orchestrator.sandbox.hierarchies import "
            f"own_cgroups; join({str(path)!r}); print(own_cgroups()[''])")  # fmt: skip
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == Path("/proc/self/cgroup").read_text().split("0::", 1)[1].split()[0], out.stderr
    finally:
        kill_members(path)
