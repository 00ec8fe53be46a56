"""A reward-hacking policy making its own verdict a ``sandbox_error``: the sandbox's failure, which fails the rollout
(it trains nothing) where the code should score 0, so a policy that finds such a way learns to take it on every task
it cannot solve. Each attack goes in through the public API; the tests assert what the host sees."""

from __future__ import annotations

import os
import time

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox.supervisor import REAP_S

from tests.sandbox.conftest import assert_serving, own_pool, run
from tests.sandbox.test_disk_bandwidth import MB, _large_files, _throttled_pool

pytestmark = pytest.mark.xdist_group("sandbox")

# Threads each reading a bound host file whole with O_DIRECT, queued behind the slot's disk throttle: a thread waits
# for such a read uninterruptibly, so SIGKILL at the wall limit takes effect only when the disk has read it all.
UNKILLABLE_READS = """
import mmap, os, threading
path, size = {path!r}, {size}
buf = mmap.mmap(-1, size)
def read():
    os.preadv(os.open(path, os.O_RDONLY | os.O_DIRECT), [buf], 0)
threads = [threading.Thread(target=read) for _ in range({threads})]
for t in threads:
    t.start()
print("reading", flush=True)
for t in threads:
    t.join()
"""


def test_verdict_a_namespace_held_past_its_kill_is_a_timeout_and_its_slot_waits():
    """Before, the supervisor waited for the killed namespace's init however long it took: 14 threads reading a 117 MB
    file at the default 50 MB/s held it 35 s past the kill, and the pool, given no verdict within ``wall_s + 30 s``,
    ended the execution as ``sandbox_error``. Here 2 threads hold it about 8 s (the throttle set to that): the verdict
    was that late. Now it comes ``REAP_S`` after the kill, the limit's own, and the slot stays out of use until its
    processes are gone."""
    files = _large_files(1)
    if not files:
        pytest.skip("no large file under /usr/share to read")
    path, threads = files[0], 2
    size = os.path.getsize(path) & ~4095
    mbps = max(1, int(threads * size / 8e6))  # the reads take about 8 s
    limits = SandboxLimits(wall_s=0.5, cpu_s=5, disk_read_mbps=mbps, disk_read_iops=None)
    with own_pool(27_000) as client:
        if client.pool._disk is None:
            pytest.skip(f"disk reads are not throttled here: {'; '.join(client.pool.unenforced)}")
        start = time.monotonic()
        result = run(client, UNKILLABLE_READS.format(path=path, size=size, threads=threads), limits=limits)
        elapsed = time.monotonic() - start
        assert (result.status, result.reason) == ("timeout", "wall time limit of 0.5 s exceeded"), result
        assert result.stdout == "reading\n" and result.exit_code == -9, result
        assert elapsed < limits.wall_s + REAP_S + 2.5, elapsed
        assert client.pool.health().quarantined == 1  # its threads still read: the slot is not lent
        assert_serving(client)  # in another slot


# Read-ahead requested for cold bound files (each call queues a window behind the slot's disk throttle, and returns).
READ_AHEAD = {
    "fadvise": "os.posix_fadvise(fd, off, 1 << 20, os.POSIX_FADV_WILLNEED)",
    "madvise": "mmap.mmap(fd, 0, prot=mmap.PROT_READ).madvise(mmap.MADV_WILLNEED, off, 1 << 20)",
    "readahead": "libc.readahead(fd, ctypes.c_longlong(off), ctypes.c_size_t(1 << 20))",
}
QUEUE_READS = """
import ctypes, mmap, os
libc = ctypes.CDLL(None)
for path in {paths!r}:
    fd = os.open(path, os.O_RDONLY)
    for off in range(0, os.fstat(fd).st_size & ~4095, 1 << 20):
        {call}
print("queued")
"""


def _evict(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("how", sorted(READ_AHEAD))
def test_neighbours_no_disk_reads_outlive_the_execution_that_asked_for_them(how):
    """Before, the host's disk went on reading for an execution after its verdict: read-ahead of 289 MiB of cold bound
    files, queued in 0.2 s, kept the slot reading 6 s after, where the next execution in the slot (anyone's) read a
    cold 29 MiB file in 6.4 s (0.6 s alone) and a host process reading a queued file waited 5.6 s for 76 MB. Here
    the host reads the first file queued right after the verdict: behind the slot's 20 MB/s, about 4 s."""
    paths = _large_files(3)
    if sum(map(os.path.getsize, paths)) < 40 * MB:
        pytest.skip("not 40 MB of large files under /usr/share to read")
    limits = SandboxLimits(wall_s=10, cpu_s=10, disk_read_mbps=20)
    with own_pool(27_100, max_concurrency=1) as client:
        _throttled_pool(client)
        _evict(paths)
        result = run(client, QUEUE_READS.format(paths=paths, call=READ_AHEAD[how]), limits=limits)
        assert (result.status, result.stdout) == ("ok", "queued\n"), result
        start = time.monotonic()
        with open(paths[0], "rb") as f:
            while f.read(1 << 20):
                pass
        waited = time.monotonic() - start
        assert waited < 2.0, waited
