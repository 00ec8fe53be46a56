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
from tests.sandbox.test_disk_bandwidth import _large_files

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
