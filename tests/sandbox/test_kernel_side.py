"""The seventh red-team pass: what the code costs the host's kernel beyond its limits (its log, shared pages, NUMA
placement) and what killed pools leave in the host's cgroups. Each test asserts what the host sees."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, cgroups, stale

from tests.sandbox import attacks
from tests.sandbox.conftest import (
    MAX_CONCURRENCY,
    SESSION_UIDS,
    UID_BASE,
    assert_no_sandbox_processes,
    assert_serving,
    own_pool,
    run,
    uid_span,
)
from tests.sandbox.test_host_shares import _waiting_runner

pytestmark = pytest.mark.xdist_group("sandbox")
x86_64 = pytest.mark.skipif(not attacks.X86_64, reason="x86_64 syscall numbers")
PR_SET_MEMORY_MERGE = 67

# Children that each allocate under RLIMIT_AS but together past the memory cgroup, re-forked as the kernel kills them
OOM_FLOOD = """
import os, time
kids = set()
while True:
    while len(kids) < 4:
        pid = os.fork()
        if pid == 0:
            try:
                b = bytearray(90 << 20)
                time.sleep(30)
            finally:
                os._exit(0)
        kids.add(pid)
    pid, _ = os.wait()
    kids.discard(pid)
"""


def kernel_oom_kills(span: range) -> int:
    """OOM kills the host's kernel log reports of processes of uids in ``span`` (one full report each)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("the kernel log is not readable here")
    return sum(int(uid) in span for uid in re.findall(r"Killed process \d+ .*UID:(\d+)", log))


def test_host_kernel_log_one_execution_past_its_memory_prints_at_most_one_oom_report(sandbox):
    # Each OOM kill printed a full report (~20 lines) into the host's kernel log: an execution re-forking children
    # that each allocate printed 955 lines in 5 s, for its whole wall limit, in every slot at once.
    span = uid_span(UID_BASE, MAX_CONCURRENCY)
    limits = SandboxLimits(wall_s=4, cpu_s=20, memory_mb=128)
    before = kernel_oom_kills(span)
    results = [run(sandbox, OOM_FLOOD, limits=limits) for _ in range(2)]
    reports = kernel_oom_kills(span) - before
    if sandbox.pool._cgroups is None:
        pytest.skip("no memory cgroup on this host")
    assert [r.status for r in results] == ["memory_limit"] * 2, results
    assert [r.reason for r in results] == ["memory limit of 128 MB exceeded"] * 2
    assert reports <= 2, f"{reports} OOM kills reported in the host's kernel log for 2 executions"
    assert_serving(sandbox)


# Eight children, each taking what its RLIMIT_AS leaves it: together past the memory cgroup, each at its limit
FILL_AND_WAIT = """
import os, time
for _ in range(8):
    if os.fork() == 0:
        held = []
        try:
            while True:
                held.append(b"x" * (4 << 20))
        except MemoryError:
            time.sleep(60)
        os._exit(0)
os.wait()
"""


def test_host_kernel_log_a_pool_of_executions_at_their_limit_at_once_all_end_and_their_slots_start_clean():
    # Every slot at its memory limit at once, their supervisors sharing the loaded host's CPU: each ends as
    # memory_limit without a kernel OOM report, and the next executions in the same slots (a stale OOM count would
    # end them at once) run to the end
    base, slots = 4_790_000, 16
    span = uid_span(SESSION_UIDS + base, slots)
    before = kernel_oom_kills(span)
    limits = SandboxLimits(wall_s=20, cpu_s=20, memory_mb=64)
    with own_pool(uid_base=base, max_concurrency=slots) as client, ThreadPoolExecutor(slots) as ex:
        if client.pool._cgroups is None:
            pytest.skip("no memory cgroup on this host")
        full = list(ex.map(lambda _: run(client, FILL_AND_WAIT, limits=limits), range(slots)))
        near = "b = b'x' * (40 << 20); print(len(b) >> 20)"
        after = list(ex.map(lambda _: run(client, near, limits=limits), range(slots)))
    assert {(r.status, r.reason) for r in full} == {("memory_limit", "memory limit of 64 MB exceeded")}, full
    assert {(r.status, r.stdout) for r in after} == {("ok", "40\n")}, after
    assert kernel_oom_kills(span) == before


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_host_kernel_log_an_oom_in_a_workspace_ends_its_execution_whoever_enters_it_meanwhile():
    # v1: a workspace's executions share its memory cgroup and OOM eventfd, and each execution entering emptied the
    # eventfd. An OOM counted before the supervisor of the execution at the limit looked was lost: its processes
    # waited at the limit (the kernel's OOM killer is off there) until its wall limit, which it ended as a timeout.
    base = 4_780_000
    with own_pool(uid_base=base) as client:
        if client.pool._cgroups is None or client.pool._cgroups.version != 1:
            pytest.skip("no cgroup v1 memory hierarchy here (v2: memory.oom.group, no eventfd)")
        ws = client.call(client.pool.open_workspace(16)).result(timeout=60)
        flood = "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})\n"
        flood += "signal.sigwait({signal.SIGUSR1})\n" + OOM_FLOOD
        limits = SandboxLimits(wall_s=8, cpu_s=20, memory_mb=128)
        with ThreadPoolExecutor(1) as ex:
            future = ex.submit(client.execute_sync, ExecRequest(code=flood, workspace=ws, limits=limits))
            deadline = time.monotonic() + 30
            while (runner := _waiting_runner(uid_span(SESSION_UIDS + base, 8))) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert runner is not None, future.result() if future.done() else "no runner"
            supervisor = int(
                next(
                    line for line in Path(f"/proc/{runner}/status").read_text().splitlines() if line.startswith("PPid")
                ).split()[1]
            )
            os.kill(supervisor, signal.SIGSTOP)  # it looks only after the next execution entered
            try:
                os.kill(runner, signal.SIGUSR1)
                key = f"w{client.pool._workspaces[ws].uid}"
                while time.monotonic() < deadline and "D" not in {_state(p) for p in client.pool._cgroups.pids(key)}:
                    time.sleep(0.01)  # a child waits at the limit: the OOM is counted
                other = client.execute_sync(ExecRequest(code="print(1)", workspace=ws, limits=limits))
            finally:
                os.kill(supervisor, signal.SIGCONT)
            result = future.result(timeout=60)
    assert (result.status, result.reason) == ("memory_limit", "memory limit of 128 MB exceeded"), result
    # Running while the workspace was at its limit, the other ends too (its memory is theirs together, as v2's
    # memory.oom.group kills every process of the cgroup)
    assert other.status in ("ok", "memory_limit"), other


# KSM, NUMA migration and the memory advice ordinary programs use; then it waits (SIGUSR2 blocked) for SIGUSR1 so the
# host can look at its memory
KERNEL_MEMORY_CALLS = (
    attacks._LIBC
    + """
import mmap, signal
size = 1 << 21
m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
mask = ctypes.c_ulong(1)
page = ctypes.c_void_p(addr)
status = ctypes.c_int(0)
calls = {
    "prctl_memory_merge": (157, 67, 1, 0, 0, 0),
    "prctl_memory_merge_high_bits": (157, (1 << 32) | 67, 1, 0, 0, 0),
    "prctl_get_memory_merge": (157, 68, 0, 0, 0, 0),
    "madvise_mergeable": (28, addr, size, 12),
    "madvise_mergeable_high_bits": (28, addr, size, (1 << 32) | 12),
    "mbind_move": (237, addr, size, 2, ctypes.byref(mask), 64, 2),
    "mbind_move_all": (237, addr, size, 2, ctypes.byref(mask), 64, 4),
    "mbind_strict_move_high_bits": (237, addr, size, 2, ctypes.byref(mask), 64, (1 << 32) | 3),
    "migrate_pages": (256, 0, 64, ctypes.byref(mask), ctypes.byref(mask)),
    "move_pages": (279, 0, 1, ctypes.byref(page), 0, ctypes.byref(status), 0),
}
for name, (nr, *args) in calls.items():
    print(name, sys_(nr, *args))
ok = {
    "madvise": [sys_(28, addr, size, advice) for advice in (4, 8, 13, 14, 15, 10, 11)],  # DONTNEED, FREE, UNMERGEABLE, HUGEPAGE, NOHUGEPAGE, DONTFORK, DOFORK
    "mbind": [sys_(237, addr, size, 2, ctypes.byref(mask), 64, flags) for flags in (0, 1)] + [sys_(237, addr, size, 0, 0, 0, 0)],
    "set_mempolicy": [sys_(238, 2, ctypes.byref(mask), 64), sys_(238, 0, 0, 0)],
}
print("ordinary", ok)
m[:] = b"x" * size
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
signal.sigwait({signal.SIGUSR1})
"""
)


@x86_64
def test_host_cpu_and_neighbours_ksm_merging_and_numa_migration_are_refused(sandbox):
    # prctl(PR_SET_MEMORY_MERGE) and madvise(MADV_MERGEABLE) opted the code's pages into KSM (a side channel between
    # executions, ksmd's CPU charged to no one), and mbind with MPOL_MF_MOVE(_ALL) migrated pages between nodes.
    with ThreadPoolExecutor(1) as ex:
        future = ex.submit(run, sandbox, KERNEL_MEMORY_CALLS, limits=SandboxLimits(wall_s=60, cpu_s=60))
        while not future.done() and (runner := _waiting_runner()) is None:
            time.sleep(0.01)
        try:
            ksm = Path(f"/proc/{runner}/ksm_stat").read_text() if not future.done() else ""
            vm_flags = [line for line in Path(f"/proc/{runner}/smaps").read_text().splitlines() if "VmFlags" in line]
        except FileNotFoundError:
            ksm, vm_flags = "", []
        if not future.done():
            os.kill(runner, signal.SIGUSR1)
        result = future.result()
    assert result.status == "ok", result
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    einval, eperm = str(-errno.EINVAL), str(-errno.EPERM)
    assert {k: v for k, v in out.items() if k.startswith(("prctl", "madvise"))} == {
        "prctl_memory_merge": einval,
        "prctl_memory_merge_high_bits": einval,
        "prctl_get_memory_merge": "0",
        "madvise_mergeable": einval,
        "madvise_mergeable_high_bits": einval,
    }, out
    moves = ("mbind_move", "mbind_move_all", "mbind_strict_move_high_bits", "migrate_pages", "move_pages")
    assert {k: out[k] for k in moves} == dict.fromkeys(moves, eperm), out
    assert out["ordinary"] == "{'madvise': [0, 0, 0, 0, 0, 0, 0], 'mbind': [0, 0, 0], 'set_mempolicy': [0, 0]}", out
    assert "ksm_merge_any: yes" not in ksm and "ksm_mergeable: yes" not in ksm, ksm
    assert not any(" mg" in line for line in vm_flags), vm_flags


@x86_64
def test_host_cpu_ksm_of_the_pools_process_does_not_pass_to_its_executions():
    # KSM set on the pool's process (systemd's MemoryKSM=yes) passed through fork and exec to the zygote and every
    # execution forked from it, whatever the filter refuses the code.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        pytest.skip("no KSM in this kernel")
    try:
        with own_pool(uid_base=4_740_000) as client:
            print_merge = attacks._LIBC + "print(sys_(157, 68, 0, 0, 0, 0))"  # PR_GET_MEMORY_MERGE
            result = run(client, print_merge)
    finally:
        libc.prctl(PR_SET_MEMORY_MERGE, 0, 0, 0, 0)
    assert (result.status, result.stdout) == ("ok", "0\n"), result


# One pool's cgroups in a process of its own: made (sweeping others'), checked, held until stdin closes, then removed
POOL_PROCESS = """
import sys
import tempfile
from prime_orchestrator.sandbox.cgroups import Cgroups
from prime_orchestrator.sandbox.stale import owned_name, sweep
made, why = Cgroups.detect(owned_name(sys.argv[1]))
assert made is not None, why
sweep({p.parent for p in made.parents.values()}, made.dirs())
print("made", flush=True)
sys.stdin.read()
print("kept" if all(d.is_dir() for d in made.dirs()) else "lost", flush=True)
made.close()
"""


def test_host_cgroups_a_killed_pools_cgroups_are_swept_and_no_live_pools_ever(tmp_path):
    # A killed pool leaves its cgroups (empty prime-sandbox-* cgroups piled up in the host's hierarchies). A pool's
    # start now removes those of pools that are provably gone, and never a live pool's, even one being made.
    probe, why = cgroups.Cgroups.detect(stale.owned_name("probe"))
    if probe is None:
        pytest.skip(f"no cgroups here: {why}")
    shared = {p.parent for p in probe.parents.values()}
    probe.close()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited: its pid is free (a reuse would carry another start time)
    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead = [d / f"prime-sandbox-dead{os.getpid()}.{dead_pid}-1-{namespace}" for d in shared]
    ownerless = [d / f"prime-sandbox-noowner{os.getpid()}" for d in shared]
    for d in dead:
        (d / "s0").mkdir(parents=True)
    for d in ownerless:
        d.mkdir()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", POOL_PROCESS, f"race{os.getpid()}-{i}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            for i in range(12)
        ]  # fmt: skip
        made = [p.stdout.readline().strip() for p in procs]
        outcomes = [p.communicate(timeout=60)[0].strip() for p in procs]
        assert [p.returncode for p in procs] == [0] * 12, outcomes
        assert made == ["made"] * 12 and outcomes == ["kept"] * 12, (made, outcomes)
        assert not any(d.exists() for d in dead), dead
        assert all(d.is_dir() for d in ownerless), ownerless
    finally:
        for d in [*ownerless, *dead]:
            for sub in (d / "s0", d):
                with contextlib.suppress(OSError):
                    sub.rmdir()


def test_sessions_two_pytest_sessions_lend_different_uids():
    # The sandbox tests of two pytest sessions on one host (two agents) shared one uid range: each counted the other's
    # zygotes and executions as its own leftovers. Each run, and each worker of a run, now has its own range.
    code = "from tests.sandbox.conftest import UID_BASE, NODE_UID_BASE; print(UID_BASE, NODE_UID_BASE)"
    bases = []
    for run_id, worker in (("one", "gw0"), ("two", "gw0"), ("two", "gw0"), ("two", "gw1")):
        env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run_id, "PYTEST_XDIST_WORKER": worker}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        bases.append(tuple(map(int, out.stdout.split())))
    # Two workers of one run (-n 2 without --dist loadgroup runs sandbox tests on both at once) too
    assert bases[1] == bases[2] and len({bases[0], bases[1], bases[3]}) == 3, bases
    spans = [uid_span(base, MAX_CONCURRENCY) for base, _ in (bases[0], bases[1], bases[3])]
    assert not set(spans[0]) & set(spans[1]) and not set(spans[1]) & set(spans[2]), bases
    assert max(max(s) for s in spans) < 2**31, bases


# A pool in a process of its own, with two executions running, then closed or dropped (the process exits without
# closing it: the finalizer's teardown); prints its folder's name, which its cgroups are named after
POOL_LIFE = """
import asyncio, sys
from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox.pool import SandboxPool
async def main(uid_base, how):
    pool = SandboxPool(SandboxPoolConfig(uid_base=uid_base, max_concurrency=4, zygotes=1))
    await pool.start()
    spin = SandboxLimits(wall_s=30, cpu_s=30)
    busy = [asyncio.ensure_future(pool.run("while 1: pass", limits=spin)) for _ in range(2)]
    print(pool.tmp_dir.name, (await pool.run("print(1)")).status, flush=True)
    if how == "close":
        await pool.close()
        await asyncio.gather(*busy, return_exceptions=True)
asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""


@pytest.mark.parametrize("how", ["close", "drop"])
def test_host_cgroups_a_pool_closed_or_dropped_leaves_no_cgroup_in_any_hierarchy(how):
    # A pool never closed (dropped, or left at interpreter exit) removed its cgroups while its zygotes still ran in
    # <cpu>/prime-sandbox/<pool>/zygotes: that directory and the pool's stayed, the stale cgroups of the cpu hierarchy.
    probe, why = cgroups.Cgroups.detect(stale.owned_name(f"probe{os.getpid()}"))
    if probe is None:
        pytest.skip(f"no cgroups here: {why}")
    probe.close()
    base = SESSION_UIDS + 4_760_000 + 1_000 * (how == "drop")
    argv = [sys.executable, "-c", POOL_LIFE, str(base), how]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, status = out.stdout.split()
    assert status == "ok", out.stdout
    find = ["find", "/sys/fs/cgroup", "-path", "*prime-sandbox*", "-name", f"*{name}*"]
    left = subprocess.run(find, capture_output=True, text=True, timeout=60).stdout.split()
    for d in sorted(left, key=len, reverse=True):  # not to pile up on the host when it fails
        with contextlib.suppress(OSError):
            for sub in Path(d).iterdir():
                if sub.is_dir():
                    sub.rmdir()
            Path(d).rmdir()
    assert left == [], left
    assert_no_sandbox_processes(span=uid_span(base, 4))


def _stale_command(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "prime_orchestrator.sandbox.stale", "--ownerless", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_host_cgroups_ownerless_cgroups_go_by_hand_and_never_one_holding_a_process():
    # Cgroups without an owner in their name (pools before owners were named, other tools) are never swept: an
    # operator removes them with a command, which keeps every one with a process anywhere in its pool's cgroups (a
    # live pool of before: its zygotes in its CPU cgroup, its memory and pids cgroups empty) or with its folder.
    probe, why = cgroups.Cgroups.detect(stale.owned_name(f"probe{os.getpid()}"))
    if probe is None:
        pytest.skip(f"no cgroups here: {why}")
    parents = [p.parent.parent / f"prime-stale-test{os.getpid()}" for p in probe.parents.values()]
    probe.close()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    names = {k: f"prime-sandbox-{k}{os.getpid()}" for k in ("old", "busy", "folder")}
    owned = f"prime-sandbox-x{os.getpid()}.{os.getpid()}-1-{namespace}"
    planted = [p / n / "s0" for p in parents for n in (*names.values(), owned)]
    for d in planted:
        d.mkdir(parents=True)
    folder = Path(tempfile.gettempdir()) / names["folder"]
    folder.mkdir()
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        busy = parents[-1] / names["busy"] / "s0"
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        under = [arg for p in parents for arg in ("--under", str(p))]
        listed = _stale_command(*under)
        assert listed.returncode == 0 and all(d.is_dir() for d in planted), listed
        lines = sorted(line.split(":")[0] for line in listed.stdout.splitlines())
        assert lines == sorted(f"{s} {names[k]}" for s, k in (("empty", "old"), ("kept", "busy"), ("kept", "folder")))
        removed = _stale_command("--remove", *under)
        assert removed.returncode == 0, removed
        assert f"removed {names['old']}: {len(parents)}" in removed.stdout, removed.stdout
        assert not any((p / names["old"]).exists() for p in parents)
        kept = [d for d in planted if names["old"] not in str(d)]
        assert all(d.is_dir() for d in kept), [d for d in kept if not d.is_dir()]
        help_ = subprocess.run([sys.executable, "-m", "prime_orchestrator.sandbox.stale", "--help"], timeout=60)
        assert help_.returncode == 0
    finally:
        sleeper.kill()
        sleeper.wait()
        folder.rmdir()
        for parent in parents:
            for d, _, _ in os.walk(parent, topdown=False):
                for _ in range(100):  # the sleeper, killed, may hold its cgroup a moment
                    try:
                        Path(d).rmdir()
                    except FileNotFoundError:
                        pass
                    except OSError:
                        time.sleep(0.02)
                        continue
                    break
