"""Tool servers under the env watch (issue #38): verifiers' shared tool server (here the tool-use calculator, started as
verifiers starts it) is found in the process tree, probed over HTTP, and named in one line when it stops answering or
exits; a rollout's own (task-scoped) server is left to its rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from prime_orchestrator.proc_tree import family
from prime_orchestrator.tool_watch import ToolWatch, http_answers, shared_tool_server

pytestmark = pytest.mark.integration


def launch_env(port_file, state_url: str = "") -> dict[str, str]:
    """verifiers' launch contract of a tool server (``serve_in_runtime``): config, port file, state channel."""
    return {**os.environ, "VF_CONFIG": "{}", "MCP_PORT_FILE": str(port_file), "VF_STATE_URL": state_url,
            "VF_STATE_SECRET": ""}  # fmt: skip


def start_tool_server(tmp_path) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / "port"
    env = launch_env(port_file)
    proc = subprocess.Popen([sys.executable, "-m", "tool_use.calculator"], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not asyncio.run(_answers(port_file)):
        assert proc.poll() is None and time.monotonic() < deadline, "the calculator did not start"
        time.sleep(0.2)
    return proc, int(port_file.read_text())


async def _answers(port_file) -> bool:
    return (
        port_file.exists()
        and port_file.read_text().strip().isdigit()
        and await http_answers(int(port_file.read_text()), 2.0)
    )


def test_a_shared_tool_server_that_stops_answering_or_exits_is_named(tmp_path):
    proc, port = start_tool_server(tmp_path)
    # A rollout's own server: only its environment matters here.
    rollout_own = subprocess.Popen(["sleep", "300"], env=launch_env(tmp_path / "p2", "http://127.0.0.1:1/state"))
    try:
        assert shared_tool_server(proc.pid) == (True, port)
        assert shared_tool_server(rollout_own.pid)[0] is False  # a task-scoped server fails only its rollout
        assert shared_tool_server(os.getpid()) == (False, None)
        watch = ToolWatch(probe_timeout_s=1.5, probe_every_s=0.5)
        assert watch.gone(family(os.getpid())) is None and watch.num_servers == 1
        assert asyncio.run(watch.silent()) is None
        os.kill(proc.pid, signal.SIGSTOP)  # a blocked event loop answers nothing either; the kernel still accepts
        start = time.monotonic()
        reason = None
        while reason is None and time.monotonic() - start < 10:
            reason = asyncio.run(watch.silent())
        took = time.monotonic() - start
        print(f"tool server stopped: named after {took:.1f} s at probe timeout 1.5 s: {reason}")
        assert reason is not None and 1.5 <= took < 5, (reason, took)
        assert reason.startswith(f"tool server pid {proc.pid} (") and "-m tool_use.calculator" in reason
        assert f"did not answer on port {port} for " in reason and "\n" not in reason
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        reason = watch.gone(family(os.getpid()))
        assert reason == (
            f"tool server pid {proc.pid} ({sys.executable} -m tool_use.calculator) on port {port} exited; its worker "
            f"pid {os.getpid()} cannot start another"
        )
    finally:
        for p in (proc, rollout_own):
            p.kill()
            p.wait(10)
