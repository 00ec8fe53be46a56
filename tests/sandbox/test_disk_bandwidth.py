"""Disk reads: an execution reading the host's files bound into it (``O_DIRECT``, or more than the page cache holds)
is throttled by its cgroup on the disk under the binds; what hides the disk is said, never a failed start.

The host measures each outcome: the bytes the pool's blkio/io cgroup counted against the time the host waited."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox.cgroups import Cgroups
from prime_orchestrator.sandbox.diskio import DiskLimits, pool_limits, read_devices
from prime_orchestrator.sandbox.pool import SandboxPool
from pydantic import ValidationError

from tests.sandbox.conftest import FAST, SESSION_UIDS, own_pool, run

pytestmark = pytest.mark.xdist_group("sandbox")
MB = 1_000_000
SECONDS = 2.0

READER = """
import mmap, os, time
files, direct = {files!r}, {direct!r}
buf, done, start = mmap.mmap(-1, 1 << 20), 0, time.monotonic()
while time.monotonic() - start < {seconds}:
    for path in files:
        fd, offset = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0)), 0
        while time.monotonic() - start < {seconds} and (n := os.preadv(fd, [buf], offset)) > 0:
            offset, done = offset + n, done + n
        os.close(fd)
print(done)
"""


def _large_files(count: int = 4) -> list[str]:
    """Large regular files of /usr that no process maps (not libraries): a buffered read of them after
    ``POSIX_FADV_DONTNEED`` goes to the disk."""
    found = []
    for d, _, names in os.walk("/usr/share"):
        for name in names:
            path = os.path.join(d, name)
            if ".so" not in name and os.path.isfile(path) and not os.path.islink(path):
                found.append((os.path.getsize(path), path))
    return [p for size, p in sorted(found, reverse=True)[:count] if size > 8 * MB]


def _read_bytes(cgroup: Path) -> int:
    """Bytes read from the disks by the processes of ``cgroup`` and below (v1 ``io_service_bytes_recursive``, v2
    ``io.stat``'s ``rbytes``, hierarchical)."""
    v1 = cgroup / "blkio.throttle.io_service_bytes_recursive"
    if v1.exists():
        return sum(int(f[2]) for f in map(str.split, v1.read_text().splitlines()) if len(f) == 3 and f[1] == "Read")
    fields = [kv.split("=") for line in (cgroup / "io.stat").read_text().splitlines() for kv in line.split()[1:]]
    return sum(int(v) for k, v in fields if k == "rbytes")


def _throttled_pool(client) -> Path:
    pool = client.pool
    if pool._disk is None or pool._cgroups is None:
        pytest.skip(f"disk reads are not throttled here: {'; '.join(pool.unenforced) or 'no cgroups'}")
    return pool._cgroups.io_dir()


def _measured(client, io: Path, codes: list[str], limits: SandboxLimits) -> tuple[int, float]:
    """Bytes the pool's cgroup counted, and the seconds the host waited, for ``codes`` run together."""
    before, start = _read_bytes(io), time.monotonic()

    async def together():
        return await asyncio.gather(*(client.pool.run(code, limits=limits) for code in codes))

    results = client.call(together()).result(timeout=120)
    elapsed = time.monotonic() - start
    assert all(r.status == "ok" for r in results), results
    return _read_bytes(io) - before, elapsed


def _reader(files: list[str], direct: bool) -> str:
    return READER.format(files=files, direct=direct, seconds=SECONDS)


def test_disk_one_execution_reading_bound_files_with_o_direct_reads_at_its_limit():
    # Before: 300-500 MB/s of the 2-core test VM's root disk for the execution's whole wall limit
    files = _large_files()
    if not files:
        pytest.skip("no large file under /usr/share")
    limits = FAST.model_copy(update={"disk_read_mbps": 10})
    with own_pool(uid_base=4_900_000) as client:
        io = _throttled_pool(client)
        read, elapsed = _measured(client, io, [_reader(files, direct=True)], limits)
    # Generous: the throttle lets a first read through at once, and the host waits longer than the code reads
    assert 1 * MB < read <= 2 * 10 * MB * elapsed + 4 * MB, (read, elapsed)
    assert not io.exists(), f"{io} left after the pool closed"


def test_disk_a_buffered_read_of_files_the_page_cache_does_not_hold_is_throttled_too():
    files = _large_files()
    if not files:
        pytest.skip("no large file under /usr/share")
    limits = FAST.model_copy(update={"disk_read_mbps": 10})
    with own_pool(uid_base=4_910_000) as client:
        io = _throttled_pool(client)
        for path in files:  # out of the host's page cache (clean pages of files nobody maps go)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        read, elapsed = _measured(client, io, [_reader(files, direct=False)], limits)
    assert read <= 2 * 10 * MB * elapsed + 4 * MB, (read, elapsed)


def test_disk_several_executions_each_read_at_their_own_limit_and_under_the_pools_total_on_v2():
    files = _large_files()
    if not files:
        pytest.skip("no large file under /usr/share")
    limits = FAST.model_copy(update={"disk_read_mbps": 10})
    with own_pool(uid_base=4_920_000, total_disk_read_mbps=15) as client:
        io = _throttled_pool(client)
        read, elapsed = _measured(client, io, [_reader(files, direct=True)] * 3, limits)
        v2 = client.pool._cgroups.version == 2
    total = 15 if v2 else 3 * 10  # v1 throttles each cgroup alone: the pool's total is not enforced there
    assert 3 * MB < read <= 2 * total * MB * elapsed + 3 * 4 * MB, (read, elapsed, v2)


def test_disk_an_overlay_under_a_bind_is_said_and_the_pool_starts():
    if os.geteuid() != 0:
        pytest.skip("mounting an overlay needs root")
    top = Path(tempfile.mkdtemp(prefix="prime-overlay-", dir="/var/tmp"))  # ro_paths may not lie under /tmp
    dirs = {n: top / n for n in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir()
    options = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(dirs["merged"])], check=False)
    if mounted.returncode != 0:
        pytest.skip("no overlay filesystem here")
    try:
        devices, hidden = read_devices([str(dirs["merged"]), "/dev/shm"])
        assert devices == [] and hidden == [f"{dirs['merged']} on overlay (no block device to throttle)"]

        async def start_and_close():
            pool = SandboxPool(
                SandboxPoolConfig(ro_paths=[str(dirs["merged"])], uid_base=SESSION_UIDS + 4_930_000, zygotes=1)
            )
            said = pool.health().unenforced
            await pool.close()
            return said

        said = asyncio.run(start_and_close())
        assert any(
            line == f"disk reads of executions from {dirs['merged']} on overlay (no block device to throttle)"
            for line in said
        ), said
    finally:
        subprocess.run(["umount", str(dirs["merged"])], check=False)
        shutil.rmtree(top, ignore_errors=True)


def test_disk_limits_are_written_in_each_cgroup_versions_format(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir(), v2.mkdir()
    DiskLimits(["254:0"], 1, tmp_path).limit("v1", 50, None)
    DiskLimits(["254:0"], 2, tmp_path).limit("v2", 50, 1000)
    assert (v1 / "blkio.throttle.read_bps_device").read_text() == "254:0 50000000"
    assert (v1 / "blkio.throttle.read_iops_device").read_text() == "254:0 0"  # 0 removes the rule
    assert (v2 / "io.max").read_text() == "254:0 rbps=50000000 riops=1000"


@pytest.mark.parametrize("delegated", ["memory pids io", "memory pids"])
def test_disk_on_v2_the_pools_total_goes_on_its_cgroup_where_io_is_delegated(tmp_path, delegated):
    # A cgroup v2 layout in plain files (this VM's io controller is bound to its v1 blkio hierarchy)
    (tmp_path / "cgroup.subtree_control").write_text(delegated)
    unenforced = []
    disk = pool_limits(Cgroups(2, {"": tmp_path}), ["254:0"], [], SandboxPoolConfig(), unenforced)
    if "io" not in delegated.split():
        assert disk is None and not (tmp_path / "io.max").exists()
        assert unenforced == [
            "disk reads of executions (no blkio cgroup hierarchy, or the io controller not delegated to the pool)"
        ]
        return
    assert unenforced == [] and (tmp_path / "io.max").read_text() == "254:0 rbps=200000000 riops=4000"
    (tmp_path / "s0").mkdir()
    disk.limit("s0", 50, 1000)
    assert (tmp_path / "s0" / "io.max").read_text() == "254:0 rbps=50000000 riops=1000"


def test_disk_on_v1_the_pools_total_is_said_unenforced_and_its_cgroup_left_unlimited(tmp_path):
    unenforced = []
    disk = pool_limits(Cgroups(1, {"blkio": tmp_path}), ["254:0"], [], SandboxPoolConfig(), unenforced)
    assert disk is not None and unenforced == [
        "disk reads of all the pool's executions together (total_disk_read_mbps): cgroup v1 throttles each "
        "execution's cgroup alone"
    ]
    assert (tmp_path / "blkio.throttle.read_bps_device").read_text() == "254:0 0"


def test_disk_a_bad_limit_is_one_line_naming_the_field():
    with pytest.raises(ValidationError, match="disk_read_mbps"):
        SandboxLimits(disk_read_mbps=0)
    with pytest.raises(ValidationError, match="total_disk_read_iops"):
        SandboxPoolConfig(total_disk_read_iops=-1)


def test_disk_an_unthrottled_execution_still_runs(sandbox):
    # None: no rule on the slot's cgroup; the slot lent again to a throttled execution gets its limits back
    limits = FAST.model_copy(update={"disk_read_mbps": None, "disk_read_iops": None})
    assert run(sandbox, "print(1)", limits=limits).stdout == "1\n"
    assert run(sandbox, "print(2)").stdout == "2\n"
