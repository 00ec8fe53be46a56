"""What the sandbox pool enforces on this host, read on the host: memory an execution holds outside its address space,
a fork bomb, and what the pool leaves in the host's cgroups once closed.

Each memory case runs twice in one call: in a pool with its cgroups as this host gives them (v1 or v2, memory and
pids, or memory alone) and in one with ``cgroups = false``, which is what a pool had on a host whose cgroups it could
not use. ``memory_outside_address_space`` writes 200 MB into ``/work`` and starts 8 children holding up to 64 MiB each
under ``memory_mb = 128`` (every process under its ``RLIMIT_AS``); ``children`` starts 8 children of 120 MB under
``memory_mb = 256``. ``fork_bomb`` forks to the end under ``processes = 32`` and counts what it reached, then the host
forks. Needs root (the sandbox pool).

    uv run python benchmarks/sandbox_host_limits.py [--label NAME] [--commit SHA]

Adds a record to ``benchmarks/results/sandbox_host_limits.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import time
from pathlib import Path

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox.pool import SandboxPool
from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sandbox_host_limits.json"

HOLD = """
import os
with open("/work/blob", "wb") as f:
    for _ in range({files_mb}):
        f.write(bytes(1 << 20))
ready_r, ready_w = os.pipe()
hold_r, hold_w = os.pipe()  # never written: each child waits on it until the execution ends
for _ in range({children}):
    if os.fork() == 0:
        chunks = []
        try:
            while len(chunks) * 4 < {child_mb}:
                chunks.append(bytearray(b"z" * (4 << 20)))
        except MemoryError:
            pass
        os.write(ready_w, b".")
        os.read(hold_r, 1)
        os._exit(0)
seen = 0
while seen < {children}:
    seen += len(os.read(ready_r, {children}))
print("all held", flush=True)
"""

FORK_BOMB = """
import os, time
reached = 1
while True:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        reached += 1
    except OSError:
        break
print(reached, flush=True)
time.sleep(60)
"""

MEMORY_CASES = {
    "memory_outside_address_space": (dict(files_mb=200, children=8, child_mb=64), dict(memory_mb=128, disk_mb=256)),
    "children": (dict(files_mb=0, children=8, child_mb=120), dict(memory_mb=256, disk_mb=64)),
}


def cgroup_mode(pool: SandboxPool) -> dict:
    made = pool._cgroups
    if made is None:
        return {"version": None}
    return {"version": made.version, "hierarchies": sorted(made.parents), "no_tasks": made.no_tasks}


async def memory_case(pool: SandboxPool, code: dict, limits: dict) -> dict:
    start = time.monotonic()
    limits = SandboxLimits(wall_s=20, cpu_s=20, processes=16, **limits)
    result = await pool.run(HOLD.format(**code), limits=limits)
    return {
        "status": result.status,
        "reason": result.reason,
        "memory_peak_mb": result.memory_peak_mb,
        "seconds": round(time.monotonic() - start, 2),
    }


async def fork_bomb(pool: SandboxPool) -> dict:
    result = await pool.run(FORK_BOMB, limits=SandboxLimits(wall_s=4, cpu_s=4, processes=32))
    host = subprocess.run(["true"], timeout=30).returncode
    return {"status": result.status, "reached": int(result.stdout or 0), "host_forks_after": host == 0}


async def one_pool(cgroups: bool) -> dict:
    config = SandboxPoolConfig(max_concurrency=2, zygotes=1, cgroups=cgroups)
    async with SandboxPool(config) as pool:
        out = {"cgroups": cgroup_mode(pool), "unenforced": list(pool.unenforced)}
        for name, (code, limits) in MEMORY_CASES.items():
            out[name] = await memory_case(pool, code, limits)
            print("cgroups" if cgroups else "no cgroups", name, out[name], flush=True)
        if cgroups:
            out["fork_bomb"] = await fork_bomb(pool)
            print("fork_bomb", out["fork_bomb"], flush=True)
        dirs = pool._cgroups.dirs() if pool._cgroups is not None else set()
    out["cgroups_left_after_close"] = sorted(str(d) for d in dirs if d.exists())
    return out


def own_cgroup() -> dict:
    """This process's cgroups and, on v2, what its parent gives it (cgroup.controllers)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    out = {"proc_self_cgroup": lines}
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    if v2 is not None and (controllers := Path("/sys/fs/cgroup" + v2) / "cgroup.controllers").exists():
        out["v2_controllers_given"] = controllers.read_text().split()
    return out


async def main() -> dict:
    return {
        "host": f"{platform.node()} ({os.cpu_count()} cores)",
        "kernel": platform.release(),
        "own_cgroup": own_cgroup(),
        "pool": await one_pool(cgroups=True),
        "pool_without_cgroups": await one_pool(cgroups=False),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label")
    parser.add_argument("--commit")
    args = parser.parse_args()
    record = asyncio.run(main())
    record["commit"] = tree_commit(args.commit or os.environ.get("PRIME_COMMIT"))
    add_record(RESULTS, args.label, record)
