"""How fast executions read the host's disk through the sandbox's binds, with and without disk read limits.

Each case runs executions that read the largest files of ``/usr`` (bound read-only inside) for ``--seconds``: with
``O_DIRECT`` (no page cache), or buffered after the host dropped its page cache (``/proc/sys/vm/drop_caches``). The
host measures what the disk served around the executions (``/sys/dev/block/MAJ:MIN/stat``, reads and sectors), so
the rate counts every read, whatever the code reports (and every other process's: the pool's blkio/io cgroup counts
the executions' alone); ``o_direct_4k`` reads 4 KiB at a time (the IOPS limit). Cases: one execution unlimited (``disk_read_mbps = None``, what
every execution could do before), one at the pool's default limits, and ``--parallel`` at once at the defaults.
Needs root (the sandbox pool) and a disk under ``/usr``.

    uv run python benchmarks/sandbox_disk_read.py [--seconds 4] [--parallel 4] [--label NAME]

Adds a record to ``benchmarks/results/sandbox_disk_read.json``: per case, MB/s (10^6 bytes) and reads a second the disk
served.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from pathlib import Path

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox.diskio import read_devices
from prime_orchestrator.sandbox.pool import SandboxPool
from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "sandbox_disk_read.json"

READER = """
import mmap, os, time
files, seconds, direct, size = {files!r}, {seconds!r}, {direct!r}, {size!r}
buf, done, start = mmap.mmap(-1, size), 0, time.monotonic()
while time.monotonic() - start < seconds:
    for path in files:
        fd, offset = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0)), 0
        while time.monotonic() - start < seconds and (n := os.preadv(fd, [buf], offset)) > 0:
            offset, done = offset + n, done + n
        os.close(fd)
print(done, time.monotonic() - start)
"""


def largest_files(top: str = "/usr", count: int = 16) -> list[str]:
    sizes = []
    for d, _, names in os.walk(top):
        for name in names:
            path = os.path.join(d, name)
            if os.path.isfile(path) and not os.path.islink(path):
                sizes.append((os.path.getsize(path), path))
    return [p for _, p in sorted(sizes, reverse=True)[:count]]


def disk_reads(device: str) -> tuple[int, int]:
    """Reads the disk completed, and sectors it read (``/sys/dev/block/MAJ:MIN/stat``)."""
    fields = Path(f"/sys/dev/block/{device}/stat").read_text().split()
    return int(fields[0]), int(fields[2])


def cgroup_reads(cgroup: Path | None) -> tuple[int, int]:
    """Reads and bytes read from the disks by the processes of the pool's blkio/io cgroup and below: the executions'
    own, where the disk's counters also count the host's."""
    if cgroup is None:
        return 0, 0
    v1 = cgroup / "blkio.throttle.io_serviced_recursive"
    if v1.exists():
        total = [
            sum(int(f[2]) for f in map(str.split, (cgroup / name).read_text().splitlines()) if f[1:2] == ["Read"])
            for name in ("blkio.throttle.io_serviced_recursive", "blkio.throttle.io_service_bytes_recursive")
        ]
        return total[0], total[1]
    stat = dict(kv.split("=") for line in (cgroup / "io.stat").read_text().splitlines() for kv in line.split()[1:])
    return int(stat.get("rios", 0)), int(stat.get("rbytes", 0))


async def case(pool: SandboxPool, device: str, codes: list[str], limits: SandboxLimits, buffered: bool) -> dict:
    if buffered:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    io = pool._cgroups.io_dir() if pool._cgroups is not None else None
    before, own, start = disk_reads(device), cgroup_reads(io), time.monotonic()
    results = await asyncio.gather(*(pool.run(code, limits=limits) for code in codes))
    elapsed, after, own_after = time.monotonic() - start, disk_reads(device), cgroup_reads(io)
    assert all(r.status == "ok" for r in results), results
    reported = sum(int(r.stdout.split()[0]) for r in results)
    return {
        "host_mb_s": round((after[1] - before[1]) * 512 / elapsed / 1e6, 1),
        "host_reads_s": round((after[0] - before[0]) / elapsed),
        "cgroup_mb_s": round((own_after[1] - own[1]) / elapsed / 1e6, 1),
        "cgroup_reads_s": round((own_after[0] - own[0]) / elapsed),
        "code_mb_s": round(reported / elapsed / 1e6, 1),
    }


async def main(args: argparse.Namespace) -> dict:
    usr = os.stat("/usr").st_dev  # /usr's own disk: another may be mounted below it (a GPU host's driver files)
    files = [f for f in largest_files(count=64) if os.stat(f).st_dev == usr][:16]
    (device,), hidden = read_devices(files[:1])
    cases = {}
    async with SandboxPool(SandboxPoolConfig(max_concurrency=max(4, args.parallel), zygotes=1)) as pool:
        defaults = pool.config.limits
        unlimited = defaults.model_copy(update={"disk_read_mbps": None, "disk_read_iops": None})
        for kind, direct, size in (
            ("o_direct", True, 1 << 20),
            ("buffered_uncached", False, 1 << 20),
            ("o_direct_4k", True, 4096),
        ):
            for name, limits, parallel in (
                ("one_unlimited", unlimited, 1),
                ("one_limited", defaults, 1),
                (f"{args.parallel}_limited", defaults, args.parallel),
            ):
                limits = limits.model_copy(update={"wall_s": args.seconds + 20, "cpu_s": args.seconds + 20})
                # files of their own: buffered readers of the same files would share the page cache
                codes = [
                    READER.format(files=files[i::parallel], seconds=args.seconds, direct=direct, size=size)
                    for i in range(parallel)
                ]
                cases[f"{kind}/{name}"] = await case(pool, device, codes, limits, not direct)
                print(kind, name, cases[f"{kind}/{name}"], flush=True)
        return {
            "host": platform.node(),
            "device": device,
            "limits": {"disk_read_mbps": defaults.disk_read_mbps, "disk_read_iops": defaults.disk_read_iops},
            "total_disk_read_mbps": pool.config.total_disk_read_mbps,
            "unenforced": pool.unenforced,
            "seconds": args.seconds,
            "cases": cases,
        }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--label")
    parser.add_argument("--commit")
    args = parser.parse_args()
    record = asyncio.run(main(args))
    record["commit"] = tree_commit(args.commit)
    add_record(RESULTS, args.label, record)
