"""Sandbox pool benchmark: cold start, warm latency, and throughput under concurrency.

Needs only the project's wheels (prime-core, prime-orchestrator) and the stdlib; run as root on any Linux host:

    uv run python benchmarks/sandbox_bench.py                      # -> benchmarks/results/sandbox_<host>.json
    python benchmarks/sandbox_bench.py --concurrency 400 --executions 8000 --tag h200

Measures, each on a fresh pool:
- cold: a pool from nothing to ready (zygote interpreter start, namespaces, root filesystem, pre-imports), and
  the first execution after it;
- warm: one execution at a time, end to end through ``SandboxPool.execute`` (request, fork, run, verdict,
  tests judged), of a 10-line Python solution against 5 tests: p50 / p99;
- cpu: CPU time per execution by process (pool, zygote, supervisor, runner), independent of other load on
  the host, and the capacity per core it implies;
- concurrency: ``--executions`` of the same request with ``--concurrency`` in flight: errors, throughput,
  throughput per core, and latency percentiles under load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox import ExecRequest, SandboxPool, TestCase
from provenance import tree_commit

SOLUTION = '''
def run_length(text):
    """Run-length encode text: 'aab' -> 'a2b1'."""
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{text[i]}{j - i}")
        i = j
    return "".join(out)
'''
TESTS = [
    TestCase(expr="run_length('')", expected=""),
    TestCase(expr="run_length('a')", expected="a1"),
    TestCase(expr="run_length('aab')", expected="a2b1"),
    TestCase(expr="run_length('zzzzzzzzzzzz')", expected="z12"),
    TestCase(expr="run_length('abcabc')", expected="a1b1c1a1b1c1"),
]
REQUEST = ExecRequest(code=SOLUTION, tests=TESTS, limits=SandboxLimits(wall_s=30, cpu_s=10))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _check(result) -> bool:
    return result.status == "ok" and result.pass_fraction == 1.0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_cold(config: SandboxPoolConfig, repeats: int) -> dict:
    ready, first, cpu = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        pool = SandboxPool(config)
        await pool.start()
        ready.append(time.perf_counter() - start)
        cpu.append(sum(_cpu_s(z.proc.pid) for z in pool._zygotes if z is not None))
        t = time.perf_counter()
        ok = _check(await pool.execute(REQUEST))
        first.append(time.perf_counter() - t)
        await pool.close()
        assert ok, "the first execution of a cold pool failed"
    return {
        "ready_ms_p50": 1e3 * statistics.median(ready),
        "ready_ms_max": 1e3 * max(ready),
        "first_execution_ms_p50": 1e3 * statistics.median(first),
        "zygote_cpu_ms_to_ready_p50": 1e3 * statistics.median(cpu),
        "repeats": repeats,
    }


async def bench_warm(pool: SandboxPool, n: int) -> dict:
    for _ in range(20):  # page in the zygote's copy-on-write state once
        await pool.execute(REQUEST)
    latencies, inner, errors = [], [], 0
    for _ in range(n):
        t = time.perf_counter()
        result = await pool.execute(REQUEST)
        latencies.append(time.perf_counter() - t)
        inner.append(result.wall_s)
        errors += not _check(result)
    return {
        "executions": n,
        "errors": errors,
        "p50_ms": 1e3 * _pct(latencies, 50),
        "p90_ms": 1e3 * _pct(latencies, 90),
        "p99_ms": 1e3 * _pct(latencies, 99),
        "max_ms": 1e3 * max(latencies),
        "in_sandbox_p50_ms": 1e3 * _pct(inner, 50),
    }


async def bench_cpu(pool: SandboxPool, n: int) -> dict:
    """CPU time per execution, by process, one execution at a time: what an execution costs whatever the load
    (wall latencies on a shared host mostly measure the wait for a core)."""
    import resource

    zygotes = [z.proc.pid for z in pool._zygotes if z is not None]
    pool_0, zyg_0 = resource.getrusage(resource.RUSAGE_SELF), sum(map(_cpu_s, zygotes))
    supervisor = runner = 0.0
    for _ in range(n):
        result = await pool.execute(REQUEST)
        supervisor += result.supervisor_cpu_s
        runner += result.cpu_s
    pool_1, zyg_1 = resource.getrusage(resource.RUSAGE_SELF), sum(map(_cpu_s, zygotes))
    per = {
        "pool_ms": 1e3 * (pool_1.ru_utime + pool_1.ru_stime - pool_0.ru_utime - pool_0.ru_stime) / n,
        "zygote_ms": 1e3 * (zyg_1 - zyg_0) / n,
        "supervisor_ms": 1e3 * supervisor / n,
        "runner_ms": 1e3 * runner / n,
    }
    total = sum(per.values())
    return {"executions": n, **per, "total_ms": total, "capacity_executions_per_s_per_core": 1e3 / total}


async def bench_concurrent(pool: SandboxPool, n: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    peak = 0
    running = 0

    async def one() -> None:
        nonlocal peak, running
        async with gate:
            running += 1
            peak = max(peak, running)
            t = time.perf_counter()
            result = await pool.execute(REQUEST)
            latencies.append(time.perf_counter() - t)
            running -= 1
        key = "ok" if _check(result) else f"{result.status}: {result.reason}"[:120]
        statuses[key] = statuses.get(key, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    elapsed = time.perf_counter() - start
    cores = len(os.sched_getaffinity(0))
    return {
        "executions": n,
        "concurrency": concurrency,
        "peak_in_flight": peak,
        "errors": n - statuses.get("ok", 0),
        "statuses": statuses,
        "seconds": elapsed,
        "executions_per_s": n / elapsed,
        "executions_per_s_per_core": n / elapsed / cores,
        "p50_ms": 1e3 * _pct(latencies, 50),
        "p99_ms": 1e3 * _pct(latencies, 99),
    }


def _device() -> dict:
    model = ""
    with contextlib.suppress(OSError, StopIteration):
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "host": socket.gethostname(),
        "cpu": model or platform.processor(),
        "cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg_1m_at_start": load,
    }


async def main(args: argparse.Namespace) -> dict:
    config = SandboxPoolConfig(max_concurrency=max(args.concurrency, 1), zygotes=args.zygotes)
    record = {
        "benchmark": "sandbox",
        "device": _device(),
        "commit": tree_commit(os.environ.get("PRIME_COMMIT")),
        "zygotes": args.zygotes or "auto",
    }
    record["cold"] = await bench_cold(config, args.cold_repeats)
    async with SandboxPool(config) as pool:
        record["warm"] = await bench_warm(pool, args.warm)
        record["cpu_per_execution"] = await bench_cpu(pool, args.warm)
        record["concurrent"] = await bench_concurrent(pool, args.executions, args.concurrency)
    record["targets"] = {
        "warm_p50_le_10ms": record["warm"]["p50_ms"] <= 10,
        "warm_p99_le_50ms": record["warm"]["p99_ms"] <= 50,
        "cold_ready_le_100ms": record["cold"]["ready_ms_p50"] <= 100,
        "concurrent_200_no_errors": args.concurrency >= 200 and record["concurrent"]["errors"] == 0,
    }
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=1000, help="sequential executions for the warm percentiles")
    parser.add_argument("--concurrency", type=int, default=200, help="executions in flight at once")
    parser.add_argument("--executions", type=int, default=4000, help="executions of the concurrency run")
    parser.add_argument("--cold-repeats", type=int, default=5, help="cold pool starts")
    parser.add_argument("--zygotes", type=int, default=0, help="zygotes (0: one per 8 cores)")
    parser.add_argument("--tag", default=None, help="result file suffix (default: the host name)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    record = asyncio.run(main(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sandbox_{args.tag or socket.gethostname()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    print(f"wrote {path}")
