"""What one harness program's flood of unauthenticated requests costs the host (sandbox ``relay`` -> verifiers'
interception server), and what another client of that server sees meanwhile.

A program execution (root: the sandbox pool) holds ``--connections`` connections to its route, verifiers' real
``InterceptionServer`` in this process, and pipelines ``GET /v1/models`` (no bearer: 401) on each for ``--seconds``.
Meanwhile a host client calls the same server every 50 ms and a ticker measures this event loop's lateness. The
same span without the flood is the baseline.

    uv run python benchmarks/relay_flood.py [--seconds 10] [--connections 32] [--label NAME]

Adds a record to ``benchmarks/results/relay_flood.json``: per phase, 401s served, CPU of this process (the pool's
relay and the interception server) against the execution's own, RSS, and the other client's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import time
from pathlib import Path

from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "relay_flood.json"
FLOOD = r"""
import selectors, socket, sys, time
port, secs, conns = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
one = b'GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n'
sel, got, end = selectors.DefaultSelector(), 0, time.time() + secs
for _ in range(conns):
    s = socket.create_connection(('127.0.0.1', port)); s.setblocking(False)
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
while time.time() < end:
    for key, events in sel.select(0.1):
        try:
            if events & selectors.EVENT_READ:
                got += key.fileobj.recv(1 << 16).count(b'HTTP/1.1 ')
            if events & selectors.EVENT_WRITE:
                key.fileobj.send(one * 200)
        except BlockingIOError:
            pass
print(got)
"""


async def _other_client(port: int, stop: asyncio.Event, latencies: list[float]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            start = time.perf_counter()
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                await r.read()
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)


async def _ticker(stop: asyncio.Event, lag: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        lag.append(time.perf_counter() - start - 0.01)


async def _phase(client, port: int, flood: bool, args) -> dict:
    from prime_core.config.sandbox import SandboxLimits
    from prime_orchestrator.sandbox import ExecRequest

    latencies, lag, stop = [], [], asyncio.Event()
    tasks = [asyncio.create_task(_other_client(port, stop, latencies)), asyncio.create_task(_ticker(stop, lag))]
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    served, code_cpu = 0, 0.0
    if flood:
        argv = ["python3", "-c", FLOOD, str(port), str(args.seconds), str(args.connections)]
        limits = SandboxLimits(wall_s=args.seconds + 30, cpu_s=args.seconds + 30)
        result = await client.execute(ExecRequest(argv=argv, limits=limits), routes=[port])
        served, code_cpu = int(result.stdout or 0), result.cpu_s
    else:
        await asyncio.sleep(args.seconds)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    await asyncio.gather(*tasks)
    latencies.sort()
    return {
        "wall_s": round(wall, 2),
        "served_401": served,
        "host_cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2),
        "code_cpu_s": round(code_cpu, 2),
        "rss_mb": round(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20),
        "other_client_p50_ms": round(latencies[len(latencies) // 2] * 1e3, 2),
        "other_client_max_ms": round(latencies[-1] * 1e3, 1),
        "loop_late_max_ms": round(max(lag) * 1e3, 1),
    }


async def main(args: argparse.Namespace) -> dict:
    from prime_core.config.sandbox import SandboxClientConfig, SandboxPoolConfig
    from prime_orchestrator.sandbox import SandboxClient
    from verifiers.v1.interception.server import InterceptionServer

    server = InterceptionServer()
    await server.start()
    client = SandboxClient(SandboxClientConfig(pool=SandboxPoolConfig(max_concurrency=2, zygotes=1, uid_base=980_000)))
    try:
        results = {phase: await _phase(client, server.port, phase == "flood", args) for phase in ("idle", "flood")}
    finally:
        client.close()
        await server.stop()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    results = asyncio.run(main(args))
    for phase, numbers in results.items():
        print(phase, numbers)
    record = {"commit": tree_commit(), "host": platform.node(), "cpus": os.cpu_count(), "seconds": args.seconds,
              "connections": args.connections, "results": results}  # fmt: skip
    add_record(RESULTS, args.label, record)
