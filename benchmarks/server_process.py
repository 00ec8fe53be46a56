"""Benchmark servers as subprocesses: a free port, waiting for /health, stopping a server and its engine processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> dict:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json() if r.content else {}  # vLLM's own /health has an empty body
        if server.poll() is not None:
            raise RuntimeError(f"server exited during startup (rc={server.returncode})")
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout:.0f}s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server, then kill its whole process group (vLLM's engine-core processes included)."""
    import signal

    if server.poll() is None:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)
