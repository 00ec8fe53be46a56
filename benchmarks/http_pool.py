"""Client CPU per request of the env server's two HTTP calls per turn, with many requests in flight: httpx's own pool
(what verifiers and the chat harness used) against httpx over aiohttp's pool (``prime_orchestrator.http_pool``).

    python benchmarks/http_pool.py [--in-flight 64 256 512] [--requests 4096] --out DIR

The server (a separate process, aiohttp, 50-150 ms per answer like a model turn) is the same for every client; the
number is the client process's CPU time over the requests. Writes <out>/http_pool.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]
BODY = {"model": "m", "messages": [{"role": "user", "content": "reverse this text " * 20}]}


def serve(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.json()
        await asyncio.sleep(random.uniform(0.05, 0.15))
        return web.json_response(
            {"choices": [{"message": {"role": "assistant", "content": "txet siht esrever " * 20}}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, backlog=4096, print=None)


def clients(url: str) -> dict:
    """Each client as the env server builds it: the harness's interception client and verifiers' engine client."""
    import httpx
    from prime_orchestrator.http_pool import engine_client, pooled_client
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import TrainClientConfig

    config = TrainClientConfig(base_url=url)
    unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return {
        "harness: httpx pool": lambda: httpx.AsyncClient(timeout=None, limits=unbounded),
        "harness: pooled (aiohttp)": pooled_client,
        "verifiers engine client: httpx pool": lambda: base.build_async_httpx(config),
        "verifiers engine client: pooled (aiohttp)": lambda: engine_client(config),
    }


async def measure(make, url: str, in_flight: int, requests: int) -> dict:
    client = make()
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            reply = await client.post(url + "/chat/completions", json=BODY, headers={"Authorization": "Bearer s"})
            reply.json()

    await asyncio.gather(*(one() for _ in range(in_flight)))  # open the connections
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await client.aclose()
    return {
        "in_flight": in_flight,
        "client_cpu_ms_per_request": 1e3 * cpu / requests,
        "requests_per_s": requests / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)

    from serve_load import free_port, host_cpu, tree_commit

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}/v1"
    report = {"benchmark": "http_pool", "host_cpu": host_cpu(), "cpus": os.cpu_count(), "commit": tree_commit(args.commit),
              "vocab_size": "n/a (HTTP only)", "config": vars(args) | {"out": str(args.out)}, "results": []}  # fmt: skip
    try:
        import httpx

        for _ in range(100):
            try:
                httpx.post(url + "/chat/completions", json=BODY)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        for name, make in clients(url).items():
            for in_flight in args.in_flight:
                entry = {"client": name} | asyncio.run(measure(make, url, in_flight, args.requests))
                print(json.dumps(entry), flush=True)
                report["results"].append(entry)
    finally:
        server.terminate()
        server.wait()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "http_pool.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
