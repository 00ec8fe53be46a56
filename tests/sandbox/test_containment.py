"""Containment: every escape attempt ends as a failed execution with a clear reason, nothing escapes, nothing is
left running, and the pool keeps serving after each."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest

from tests.sandbox.conftest import assert_no_sandbox_processes, assert_serving, run

pytestmark = pytest.mark.xdist_group("sandbox")


def test_writes_outside_the_workdir_fail(sandbox, tmp_path):
    target = tmp_path / "planted"
    for path in ("/usr/planted", "/etc/planted", "/planted", "/.ws/planted", str(target)):
        result = run(sandbox, f"open({path!r}, 'w').write('x')")
        assert result.status == "error", path
        assert any(r in result.reason for r in ("Read-only file system", "Permission denied", "No such file")), result
    assert not target.exists() and not Path("/usr/planted").exists() and not Path("/etc/planted").exists()
    remount = run(sandbox, "import ctypes\nassert ctypes.CDLL(None).mount(b'x', b'/usr', None, 32 | 4096, None) == 0")
    assert remount.status == "error"
    assert_serving(sandbox)


def test_host_files_are_not_readable(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    project_file = Path(__file__).resolve()
    paths = ["/etc/shadow", str(secret), str(project_file), os.path.expanduser("~/.ssh"), "/proc/1/environ"]
    for path in paths:
        result = run(
            sandbox, f"import os\nprint(os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())"
        )
        assert result.status == "error", (path, result)
        assert "No such file or directory" in result.reason, result
        assert "host secret" not in result.stdout
    listing = run(sandbox, "import os\nprint(sorted(os.listdir('/')))")
    assert (
        listing.stdout.strip()
        == "['.programs', '.ws', 'bin', 'dev', 'etc', 'lib', 'lib64', 'opt', 'root', 'sbin', 'tmp', 'usr', 'work']"
    )
    for hidden in ("/.ws", "/.programs"):  # workspaces; the packages only a harness program gets (programs.py)
        denied = run(sandbox, f"import os\nos.listdir({hidden!r})")
        assert denied.status == "error" and "Permission denied" in denied.reason, hidden
    assert run(sandbox, "import os\nprint(os.listdir('/opt/prime/site-packages'))").stdout == "[]\n"
    assert_serving(sandbox)


def test_no_network_even_to_a_host_loopback_server(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        result = run(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.status == "error" and "Network is unreachable" in result.reason, result
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()
    assert_serving(sandbox)


def test_fork_bomb(sandbox):
    result = run(sandbox, "import os\nwhile True:\n    os.fork()", limits=SandboxLimits(wall_s=5, processes=16))
    assert result.status in ("error", "timeout"), result
    assert result.reason, result
    assert_serving(sandbox)


def test_memory_bomb(sandbox):
    result = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))")
    assert result.status == "memory_limit" and "512 MB" in result.reason, result
    result = run(sandbox, "huge = bytearray(1 << 34)")
    assert result.status == "memory_limit", result
    assert_serving(sandbox)


def test_infinite_loop(sandbox):
    result = run(sandbox, "while True:\n    pass", limits=SandboxLimits(wall_s=1, cpu_s=10))
    assert result.status == "timeout" and "wall time limit of 1.0 s" in result.reason, result
    result = run(sandbox, "while True:\n    pass", limits=SandboxLimits(wall_s=60, cpu_s=1))
    assert result.status == "timeout" and "CPU time limit" in result.reason, result
    assert_serving(sandbox)


def test_100mb_of_stdout(sandbox):
    result = run(sandbox, "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)")
    assert result.status == "output_limit" and len(result.stdout) <= 1 << 20, result.reason
    assert_serving(sandbox)


def test_killing_the_parent_or_the_pool_from_inside(sandbox):
    code = (
        "import os, signal\n"
        "print(os.getpid(), os.getppid())\n"
        "for pid in range(2, 4096):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
        "os.kill(1, signal.SIGKILL)\n"
        "print('alive')\n"
    )
    result = run(sandbox, code)
    # PID 1 of its own namespace: its parent is out of sight, and there is nobody else to kill.
    assert (result.status, result.stdout.split()) == ("ok", ["1", "0", "ProcessLookupError", "alive"]), result
    assert_serving(sandbox)


def test_pool_survives_its_zygote_being_killed(sandbox):
    pool = sandbox.pool
    zygote = pool._zygotes[0]
    running = sandbox.call(pool.execute(ExecRequest(code="import time\ntime.sleep(30)", limits=SandboxLimits()))).result
    time.sleep(0.3)
    os.kill(zygote.proc.pid, signal.SIGKILL)
    result = running(timeout=20)
    assert result.status == "sandbox_error" and "died" in result.reason, result
    assert_serving(sandbox)


def test_background_processes_die_with_the_execution(sandbox):
    daemon = (
        "import os, subprocess, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
    )
    result = run(sandbox, daemon + "while True:\n    pass", limits=SandboxLimits(wall_s=5))
    assert result.status == "timeout"
    assert_no_sandbox_processes()
    result = run(sandbox, daemon + "print('bye')")
    assert (result.status, result.stdout) == ("ok", "bye\n")
    assert_serving(sandbox)


def test_a_cpu_limit_kill_is_a_timeout_when_the_rusage_reads_short():
    """The kernel's CPU-limit SIGKILL of a process whose rusage read 0.89 s of a 1 s limit (a CI host under load) was
    reported as an error ("killed by signal SIGKILL"), not the timeout it is."""
    import signal

    from prime_orchestrator.sandbox.supervisor import _classify

    limits = {"wall_s": 60, "cpu_s": 1, "output_bytes": 1 << 20, "memory_mb": 512, "processes": 32}
    verdict = _classify(limits, None, -signal.SIGKILL, 0.89, "", b"")
    assert verdict == {"status": "timeout", "reason": "CPU time limit of 1 s exceeded"}
    assert _classify(limits, None, -signal.SIGKILL, 0.2, "", b"")["status"] == "error"  # killed early: not the limit
