"""A host whose cgroups give the pool ``memory`` but not ``pids`` (a GPU host's job cgroup v2 given ``memory`` only,
SLURM job cgroups, some containers; a v1 host without a pids hierarchy): the pool had no cgroups at all there, and an
execution's memory outside its address space (tmpfs files, many processes each under RLIMIT_AS) went unbounded. It now
makes memory cgroups alone and names what goes free: the host-wide task cap.

This VM is cgroup v1 with both hierarchies: the pool is shown it without the pids one (``cgroups.mounts``), and each
outcome is read on the host."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, cgroups
from prime_orchestrator.sandbox.leases import Leases
from prime_orchestrator.sandbox.stale import owned_name

from tests.sandbox.conftest import SESSION_UIDS, own_pool, sandbox_pids, uid_span
from tests.sandbox.test_reach import FORK_TO_THE_LIMIT

pytestmark = pytest.mark.xdist_group("sandbox")

# 200 MB of /work files, then 8 children each holding what its RLIMIT_AS leaves it (up to 64 MiB), all at once
FILES_AND_CHILDREN = """
import os
with open("/work/fill", "wb") as f:
    for _ in range(200):
        f.write(b"x" * (1 << 20))
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
for _ in range(8):
    if os.fork() == 0:
        os.close(go_w)  # the parent's close is the go: EOF once no child holds it either
        held = []
        try:
            while len(held) < 16:
                held.append(b"y" * (4 << 20))
        except MemoryError:
            pass
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        os._exit(0)
got = b""
while len(got) < 8:
    got += os.read(ready_r, 8)
print("held", flush=True)
os.close(go_w)
for _ in range(8):
    os.wait()
"""


@pytest.fixture
def no_pids(monkeypatch):
    """This host's cgroup hierarchies without the pids one (skips where there is no v1 memory hierarchy to show)."""
    real = cgroups.mounts()
    if "memory" not in real:
        pytest.skip("no cgroup v1 memory hierarchy here")
    monkeypatch.setattr(cgroups, "mounts", lambda: {c: m for c, m in real.items() if c != "pids"})


def test_memory_only_an_execution_holding_memory_outside_its_address_space_ends_memory_limit(no_pids):
    # 200 MB of tmpfs files and 8 children of up to 64 MiB each under memory_mb=128: each process stays under its
    # RLIMIT_AS, together they held 700 MB (ok) with no cgroups; the memory cgroup holds them to 128 + 256 MB.
    limits = SandboxLimits(wall_s=30, cpu_s=30, memory_mb=128, disk_mb=256)
    with own_pool(uid_base=4_940_000, max_concurrency=2) as client:
        pool = client.pool
        unenforced = pool.health().unenforced
        result = client.execute_sync(ExecRequest(code=FILES_AND_CHILDREN, limits=limits))
        dirs = pool._cgroups.dirs() if pool._cgroups is not None else set()
    assert (result.status, result.reason) == ("memory_limit", "memory limit of 128 MB exceeded"), result
    assert result.memory_peak_mb is not None and result.memory_peak_mb <= 128 + 256 + 1, result
    tasks = [u for u in unenforced if "task" in u]
    assert len(tasks) == 1 and "host-wide task cap" in tasks[0] and "no cgroup v1 pids hierarchy" in tasks[0], (
        unenforced
    )
    assert "RLIMIT_NPROC" in tasks[0], tasks
    assert not [u for u in unenforced if "memory" in u], unenforced
    assert dirs and not [d for d in dirs if d.exists()], "the pool's cgroups stayed after close"


def test_memory_only_a_fork_bomb_is_held_to_its_processes_by_its_uid_and_the_host_still_forks(no_pids):
    # Without a pids cgroup, RLIMIT_NPROC of the slot's own uid bounds the execution's tasks; the host forks beside it
    # and the slot's memory cgroup, which the pool kills by, lists every one of its processes.
    limits = SandboxLimits(wall_s=3, cpu_s=3, processes=32)
    with own_pool(uid_base=4_950_000, max_concurrency=2) as client:
        pool = client.pool
        assert pool._cgroups is not None and pool._cgroups.no_tasks, pool.unenforced
        future = client.call(pool.execute(ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)))
        listed = 0
        while not future.done() and listed < 20:
            listed = max(listed, *(len(pool._cgroups.pids(key)) for key in ("s0", "s1")))
            time.sleep(0.01)
        host = subprocess.run(["true"], timeout=30)
        while not future.done():
            listed = max(listed, *(len(pool._cgroups.pids(key)) for key in ("s0", "s1")))
            time.sleep(0.01)
        result = future.result(timeout=60)
    assert host.returncode == 0
    assert result.status == "timeout" and 0 < int(result.stdout) < 32, result  # the runner is one of the 32
    assert 20 <= listed <= 32, listed


def test_memory_only_a_cancelled_execution_leaves_no_process(no_pids):
    # Its supervisor killed, its slot held until nothing of it lives: 8 children in sessions of their own included.
    code = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n        break\n"
    code += "print('forked', flush=True)\ntime.sleep(60)"
    limits = SandboxLimits(wall_s=60, cpu_s=60, processes=16)

    async def cancel_one(pool) -> int:
        task = asyncio.ensure_future(pool.execute(ExecRequest(code=code, limits=limits)))
        while (listed := len(pool._cgroups.pids("s0"))) < 9 and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while pool.health().running:  # the slot comes back once the reaper found its cgroup empty
            await asyncio.sleep(0.01)
        return listed

    with own_pool(uid_base=4_960_000, max_concurrency=2) as client:
        pool = client.pool
        assert pool._cgroups is not None and pool._cgroups.no_tasks, pool.unenforced
        listed = client.call(cancel_one(pool)).result(timeout=60)
        left = pool._cgroups.pids("s0"), sandbox_pids(uid_span(SESSION_UIDS + 4_960_001, 2))
    assert listed == 9 and left == ([], []), (listed, left)  # the runner and its 8 children, then nothing


def test_memory_only_the_reaper_kills_what_a_slots_memory_cgroup_lists(no_pids):
    # A killed execution's leftovers are found by the slot's cgroup: its memory one, where there is no pids one.
    made, why = cgroups.Cgroups.detect(owned_name(f"prime-sandbox-memonly{SESSION_UIDS}"))
    assert made is not None and made.no_tasks and "pids" not in made.parents, why
    left = subprocess.Popen(["sleep", "120"])
    try:
        made.enter("s0", 64, 8)
        (made.parents["memory"] / "s0" / "cgroup.procs").write_text(str(left.pid))
        assert made.pids("s0") == [left.pid]
        uid = SESSION_UIDS + 4_970_001  # not the process's: only the cgroup finds it
        asyncio.run(asyncio.wait_for(Leases(1, uid - 1, made)._reap("s0", uid), 30))
        assert left.wait(timeout=10) == -9 and made.pids("s0") == []
    finally:
        left.kill()
        left.wait()
        made.close()
    assert not [d for d in made.dirs() if d.exists()]


def test_memory_only_a_pids_hierarchy_the_pool_cannot_use_leaves_memory_enforced(tmp_path):
    # A pids hierarchy mounted but not writable (a container's read-only mount): the pool had no cgroups at all
    (tmp_path / "memory").mkdir()  # no pids hierarchy there: its shared cgroup cannot be made
    parents = {c: tmp_path / c / "shared" / "pool" for c in ("memory", "pids")}
    made, why = cgroups.Cgroups._make(1, parents)
    assert made is not None and set(made.parents) == {"memory"}, why
    assert made.no_tasks.startswith(f"cannot create {parents['pids']}"), made.no_tasks
    made._set_limits("s0", 64 << 20, 8)
    assert (parents["memory"] / "s0" / "memory.limit_in_bytes").read_text() == str(64 << 20)
    made.close()
