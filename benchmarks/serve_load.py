"""Benchmark servers as subprocesses (a free port, waiting for /health, stopping a server and its engine processes)
and the load sent to them (every token-in request in flight at once)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time

from provenance import tree_commit

__all__ = ["free_port", "host_cpu", "tree_commit", "wait_healthy"]


def host_cpu() -> str:
    """The host's CPU model and core count: server throughput depends on it (host-side scheduling and IPC), so
    records from different hosts are compared with it in view."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"{model or 'unknown'}, {os.cpu_count()} cores"


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


def request_body(r: dict) -> bytes:
    import msgspec

    sp = {"max_tokens": r["max_tokens"], "ignore_eos": True}
    if r["seed"] is not None:
        sp["seed"] = r["seed"]
    if r.get("logprobs") is not None:
        sp["logprobs"] = r["logprobs"]
    return msgspec.json.encode({"token_ids": r["prompt"], "sampling_params": sp})


async def post_all(url: str, bodies: list[bytes], client: str) -> tuple[float, list[float], list[bytes]]:
    """POST every body at once: (elapsed, each response's arrival time from the start, response bodies).
    aiohttp by default: httpx's pool costs the client seconds at 512 connections (the orchestrator's client)."""
    target, headers = f"{url}/inference/v1/generate", {"content-type": "application/json"}
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        session = httpx.AsyncClient(timeout=3600, limits=limits)

        async def one(body: bytes) -> tuple[float, bytes]:
            r = (await session.post(target, content=body, headers=headers)).raise_for_status()
            return time.perf_counter(), r.content
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(3600))

        async def one(body: bytes) -> tuple[float, bytes]:
            async with session.post(target, data=body, headers=headers, raise_for_status=True) as r:
                data = await r.read()
            return time.perf_counter(), data

    async with session:
        start = time.perf_counter()
        done = await asyncio.gather(*[one(b) for b in bodies])
        elapsed = time.perf_counter() - start
    return elapsed, [t - start for t, _ in done], [d for _, d in done]
