"""Sandbox pool benchmark: cold start, warm latency beside bubblewrap and a plain subprocess, what the system-call
filter and the cgroups cost, and throughput under concurrency.

Needs only the project's wheels (prime-core, prime-orchestrator) and the stdlib, plus ``bwrap`` on PATH for its
baseline (``apt-get install bubblewrap``; left out without it); run as root on any Linux host:

    uv run python benchmarks/sandbox_bench.py                      # -> benchmarks/results/sandbox_<host>.json
    python benchmarks/sandbox_bench.py --concurrency 400 --executions 8000 --tag h200

Measures:
- cold: a pool from nothing to ready (zygote interpreter start, namespaces, root filesystem, pre-imports), and
  the first execution after it;
- warm: one execution at a time of a 10-line Python solution against 5 tests, p50 / p90 / p99, for: the pool as
  configured (``pool``: seccomp and cgroups on), the pool without the filter (``pool_no_seccomp``), without
  cgroups (``pool_no_cgroups``), without both (``pool_bare``), ``bwrap`` (all namespaces, no capabilities, the
  same seccomp program, ``python -I -S`` running the solution and tests) and a plain ``python -I -S`` subprocess.
  The variants take turns in rounds, so a host whose load changes over the run weighs on each alike;
- cpu: CPU time per execution by process (pool, zygote, supervisor, runner; for the plain subprocess the
  children's), counted over the same turns as the latencies: the part of the cost that depends least on other
  load on the host (kernel work done in worker threads, such as tearing down an execution's network namespace, is
  in no process's account; bwrap's processes are reaped inside its PID namespace, out of reach of this count);
- concurrency: ``--executions`` of the same request with ``--concurrency`` in flight on the pool as configured:
  errors, throughput, throughput per core, and latency percentiles under load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
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
# The baselines run the same solution and tests in a fresh interpreter, printing one JSON value per test.
HARNESS = (
    "import json, sys\nns = {'__name__': '__main__'}\nexec(compile(sys.argv[1], 'solution.py', 'exec'), ns)\n"
    "for expr in sys.argv[2:]:\n    print(json.dumps(eval(expr, ns)))\n"
)
POOL_VARIANTS = {
    "pool": {},
    "pool_no_seccomp": {"seccomp": False},
    "pool_no_cgroups": {"cgroups": False},
    "pool_bare": {"seccomp": False, "cgroups": False},
}


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


class Baseline:
    """A fresh interpreter per execution: ``subprocess`` alone, or inside ``bwrap`` with the pool's filter."""

    def __init__(self, kind: str, python: str) -> None:
        self.kind, self.python = kind, python
        self.argv = [python, "-I", "-S", "-c", HARNESS, SOLUTION, *[t.expr for t in TESTS]]
        if kind == "bwrap":
            from prime_orchestrator.sandbox.seccomp import compile_filter

            self.filter = compile_filter()
            prefix = str(Path(python).resolve().parent.parent)
            self.argv = [
                *("bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"),
                *("--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"),
                *("--symlink", "usr/bin", "/bin", "--ro-bind", prefix, prefix, "--dev", "/dev", "--tmpfs", "/work"),
                *("--chdir", "/work", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--seccomp", "{fd}"),
                "--",
                *self.argv,
            ]

    async def execute(self) -> bool:
        fds, argv = [], self.argv
        if self.kind == "bwrap":  # bwrap reads the program to EOF: a fresh descriptor each time
            fd = os.memfd_create("seccomp")
            os.write(fd, self.filter)
            os.lseek(fd, 0, os.SEEK_SET)
            fds, argv = [fd], [a.replace("{fd}", str(fd)) for a in argv]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=fds
            )
            out, _ = await proc.communicate()
        finally:
            for fd in fds:
                os.close(fd)
        got = [json.loads(line) for line in out.splitlines()]
        return proc.returncode == 0 and got == [t.expected for t in TESTS]


class PoolRunner:
    """One pool variant of the warm comparison; sums the CPU its executions report (supervisor, runner)."""

    kind = "pool"

    def __init__(self, pool: SandboxPool) -> None:
        self.pool, self.supervisor, self.runner = pool, 0.0, 0.0

    async def execute(self) -> bool:
        result = await self.pool.execute(REQUEST)
        self.supervisor += result.supervisor_cpu_s
        self.runner += result.cpu_s
        return _check(result)

    def cpu(self) -> dict[str, float]:
        zygotes = sum(_cpu_s(z.proc.pid) for z in self.pool._zygotes if z is not None)
        return {"zygote_ms": zygotes, "supervisor_ms": self.supervisor, "runner_ms": self.runner}


def _rusage(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _cpu_snapshot(runner) -> dict[str, float]:
    """Cumulative CPU seconds by part; this process's own is the caller's (the pool, or the subprocess spawner).
    bwrap's processes are reaped inside its PID namespace, out of RUSAGE_CHILDREN: its CPU is not counted."""
    snap = {"pool_ms" if runner.kind == "pool" else "caller_ms": _rusage(resource.RUSAGE_SELF)}
    if runner.kind == "pool":
        snap.update(runner.cpu())
    elif runner.kind == "subprocess":
        snap["children_ms"] = _rusage(resource.RUSAGE_CHILDREN)
    return snap


async def bench_warm(runners: dict, rounds: int, per_round: int) -> tuple[dict, dict]:
    """Sequential executions, the variants taking turns in ``rounds`` rounds of ``per_round`` each: latency
    percentiles, and CPU per execution by part (counted over the same turns, so load changes weigh alike)."""
    for runner in runners.values():
        for _ in range(10):  # page in the zygote's copy-on-write state, fill the page cache
            await runner.execute()
    latencies: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, dict[str, float]] = {name: {} for name in runners}
    errors = dict.fromkeys(runners, 0)
    for _ in range(rounds):
        for name, runner in runners.items():
            before = _cpu_snapshot(runner)
            for _ in range(per_round):
                t = time.perf_counter()
                ok = await runner.execute()
                latencies[name].append(time.perf_counter() - t)
                errors[name] += not ok
            for part, value in _cpu_snapshot(runner).items():
                cpu[name][part] = cpu[name].get(part, 0.0) + value - before[part]
    warm = {
        name: {
            "executions": len(lat),
            "errors": errors[name],
            "p50_ms": 1e3 * _pct(lat, 50),
            "p90_ms": 1e3 * _pct(lat, 90),
            "p99_ms": 1e3 * _pct(lat, 99),
            "max_ms": 1e3 * max(lat),
        }
        for name, lat in latencies.items()
    }
    per_execution = {}
    for name, parts in cpu.items():
        n = len(latencies[name])
        per_execution[name] = {part: 1e3 * v / n for part, v in parts.items()}
        per_execution[name]["total_ms"] = sum(per_execution[name].values())
        if runners[name].kind != "bwrap":
            per_execution[name]["capacity_executions_per_s_per_core"] = 1e3 / per_execution[name]["total_ms"]
    return warm, per_execution


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
        "nice": os.nice(0),  # run under `nice -n -20` to measure the pool as a dedicated node would see it
    }


def warm_before(src: Path, executions: int, zygotes: int) -> dict:
    """The warm percentiles of the pool in another source tree (``src`` holds its ``prime_orchestrator``), in a
    subprocess of this same benchmark: the "before" of a change, measured beside it."""
    argv = [sys.executable, __file__, "--warm-only", "--warm", str(executions), "--zygotes", str(zygotes)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.splitlines()[-1])


async def warm_only(args: argparse.Namespace) -> dict:
    config = SandboxPoolConfig(max_concurrency=8, zygotes=args.zygotes, uid_base=990_000)
    async with SandboxPool(config) as pool:
        import prime_orchestrator

        warm, cpu = await bench_warm({"pool": PoolRunner(pool)}, 1, args.warm)
    return {**warm["pool"], "cpu_per_execution": cpu["pool"], "source": str(Path(prime_orchestrator.__file__).parent)}


async def main(args: argparse.Namespace) -> dict:
    base = SandboxPoolConfig(max_concurrency=max(args.concurrency, 1), zygotes=args.zygotes)
    record = {
        "benchmark": "sandbox",
        "device": _device(),
        "commit": tree_commit(os.environ.get("PRIME_COMMIT")),
        "zygotes": args.zygotes or "auto",
    }
    if args.before_src:
        record["before"] = {"first": await asyncio.to_thread(warm_before, args.before_src, args.warm, args.zygotes)}
    record["cold"] = await bench_cold(base, args.cold_repeats)
    pools = {}
    for i, (name, overrides) in enumerate(POOL_VARIANTS.items()):
        uid_base = 900_000 + i * 10_000  # separate ranges: the pools live side by side in this one process
        pools[name] = SandboxPool(base.model_copy(update={"uid_base": uid_base, **overrides}))
        await pools[name].start()
    record["unenforced"] = pools["pool"].unenforced
    python = os.path.realpath(sys.executable)
    baselines = {"subprocess": Baseline("subprocess", python)}
    if shutil.which("bwrap"):
        baselines["bwrap"] = Baseline("bwrap", python)
    runners = {name: PoolRunner(p) for name, p in pools.items()} | baselines
    try:
        per_round = max(1, args.warm // args.rounds)
        record["warm"], record["cpu_per_execution"] = await bench_warm(runners, args.rounds, per_round)
        for name, p in pools.items():
            if name != "pool":
                await p.close()
        record["concurrent"] = await bench_concurrent(pools["pool"], args.executions, args.concurrency)
        record["pool_health"] = pools["pool"].health().model_dump()
    finally:
        for p in pools.values():
            if not p.closed:
                await p.close()
    warm, cpu = record["warm"], record["cpu_per_execution"]
    record["costs"] = {
        what: {
            "warm_p50_ms": warm["pool"]["p50_ms"] - warm[without]["p50_ms"],
            "cpu_ms": cpu["pool"]["total_ms"] - cpu[without]["total_ms"],
        }
        for what, without in (("seccomp", "pool_no_seccomp"), ("cgroups", "pool_no_cgroups"), ("both", "pool_bare"))
    }
    record["targets"] = {
        "warm_p50_le_10ms": warm["pool"]["p50_ms"] <= 10,
        "warm_p99_le_50ms": warm["pool"]["p99_ms"] <= 50,
        "cold_ready_le_100ms": record["cold"]["ready_ms_p50"] <= 100,
        "concurrent_200_no_errors": args.concurrency >= 200 and record["concurrent"]["errors"] == 0,
    }
    if args.before_src:
        record["before"]["last"] = await asyncio.to_thread(warm_before, args.before_src, args.warm, args.zygotes)
        record["before"]["commit"] = args.before_commit
    record["device"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=1000, help="sequential executions of each variant (warm)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds the warm variants take turns in")
    parser.add_argument("--concurrency", type=int, default=200, help="executions in flight at once")
    parser.add_argument("--executions", type=int, default=4000, help="executions of the concurrency run")
    parser.add_argument("--cold-repeats", type=int, default=5, help="cold pool starts")
    parser.add_argument("--zygotes", type=int, default=0, help="zygotes (0: one per 8 cores)")
    parser.add_argument("--tag", default=None, help="result file suffix (default: the host name)")
    parser.add_argument(
        "--before-src",
        type=Path,
        default=None,
        help="a source tree's packages/prime-orchestrator/src: its pool's warm latency is measured first and last, as the before",
    )
    parser.add_argument("--before-commit", default=None, help="the commit of --before-src, for the record")
    parser.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.warm_only:
        print(json.dumps(asyncio.run(warm_only(args))))
        raise SystemExit(0)
    record = asyncio.run(main(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sandbox_{args.tag or socket.gethostname()}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    print(f"wrote {path}")
