"""What the kernel counts per user across namespaces: an execution's uid is in the zygote's user namespace, and some
counts of such a uid are also charged to the namespace's creator, host root (every process of the trainer, the
inference server and the pool). Each test takes all it can from inside and asserts what the host still has."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits

from tests.sandbox.conftest import SESSION_UIDS, assert_serving, own_pool, run, sandbox_pids

pytestmark = pytest.mark.xdist_group("sandbox")
MEMLOCK_KB = 64  # the runner's RLIMIT_MEMLOCK

# POSIX timers, each holding one of the signals its uid may have queued (RLIMIT_SIGPENDING), taken until the kernel
# refuses; then SIGUSR2 blocked (the host's sign that it holds them: sigtimedwait unblocks the signal it waits for) and
# SIGUSR1 waited for (the host sends it once it has looked).
HOLD_TIMERS = """
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int), ("pad", ctypes.c_char * 48)]
event, timer, held = SigEvent(notify=1), ctypes.c_void_p(), 0  # SIGEV_NONE
while held < 200_000 and libc.timer_create(1, ctypes.byref(event), ctypes.byref(timer)) == 0:
    held += 1
print("timers", held, flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
signal.sigtimedwait({signal.SIGUSR1}, 60)
"""


class _SigEvent(ctypes.Structure):
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("pad", ctypes.c_char * 48),
    ]


def _host_timer() -> int:
    """0 when a host root process can still create a POSIX timer, else the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    timer = ctypes.c_void_p()
    if libc.timer_create(1, ctypes.byref(_SigEvent(notify=1)), ctypes.byref(timer)) != 0:
        return ctypes.get_errno()
    libc.timer_delete(timer)
    return 0


def _status(pid: int | str, field: str) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field + ":")), "")


def _waiting_runner(span: range | None = None) -> int | None:
    """The runner of the one execution running, once it blocks SIGUSR2 (it holds what it took then)."""
    for pid in sandbox_pids(span):
        if int(_status(pid, "SigBlk") or "0", 16) & (1 << (signal.SIGUSR2 - 1)):
            return pid
    return None


def test_timers_and_queued_signals_leave_host_root_its_own(sandbox):
    # RLIMIT_SIGPENDING counts a uid's queued signals and POSIX timers, and the kernel charges those of a user
    # namespace's uids to its creator too. The runner inherited the host's limit (96,365 here): one execution took
    # 96,361 timers, all of host root's, and every root process on the host got EAGAIN from timer_create and
    # sigqueue until the execution ended.
    limit = resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]
    if limit == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_SIGPENDING is not limited on this host")
    before = int(_status("self", "SigQ").split("/")[0])
    with ThreadPoolExecutor(1) as ex:
        future = ex.submit(run, sandbox, HOLD_TIMERS, limits=SandboxLimits(wall_s=60, cpu_s=60))
        while not future.done() and (runner := _waiting_runner()) is None:
            time.sleep(0.01)
        taken = int(_status("self", "SigQ").split("/")[0]) - before
        host = _host_timer()
        if not future.done():
            os.kill(runner, signal.SIGUSR1)
        result = future.result()
    assert result.status == "ok" and result.stdout.startswith("timers "), result
    held = int(result.stdout.split()[1])
    assert host == 0, f"host root's timer_create failed with errno {host} while the execution held {held} timers"
    # what host root lost to it (other root processes on the host move this count a little too)
    assert held > 0 and taken <= limit // 2, (held, taken, limit)
    assert_serving(sandbox)


# Pages of host files locked in memory: the bound files' page cache is the host's (a page already cached stays charged
# to whoever read it first, not to the execution's memory cgroup), and a locked page is never reclaimed. Maps what it
# finds under /usr and locks up to 64 MiB of it, then waits for SIGUSR1 like HOLD_TIMERS.
LOCK_HOST_PAGES = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
locked = 0
for top, _, files in os.walk("/usr"):
    for name in files:
        path = os.path.join(top, name)
        size = min(os.path.getsize(path), (64 << 20) - locked) if os.path.isfile(path) else 0
        if size < (1 << 20):
            continue
        fd = os.open(path, os.O_RDONLY)
        address = libc.mmap(None, size, 1, 2, fd, 0)  # PROT_READ, MAP_PRIVATE
        os.close(fd)
        if address not in (None, ctypes.c_void_p(-1).value) and libc.mlock(address, size) == 0:
            locked += size
    if locked >= 64 << 20:
        break
print("locked", locked, flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
signal.sigtimedwait({signal.SIGUSR1}, 60)
"""


def test_host_file_pages_locked_in_memory_are_bounded():
    # RLIMIT_MEMLOCK was inherited from the pool's process: unlimited on a GPU host (`ulimit -l unlimited`, what
    # NCCL and InfiniBand want), and the code pinned host page cache that no memory cgroup of its own counts (8 MiB a
    # process where the host keeps the kernel's default and the pool cannot raise it, as on the 2-core test VM).
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    with contextlib.suppress(ValueError, OSError):  # without CAP_SYS_RESOURCE: the host's own limit
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    try:
        with own_pool(uid_base=370_000) as client, ThreadPoolExecutor(1) as ex:
            span = range(SESSION_UIDS + 370_001, SESSION_UIDS + 370_100)  # own_pool's uids
            future = ex.submit(run, client, LOCK_HOST_PAGES, limits=SandboxLimits(wall_s=60, cpu_s=60, memory_mb=256))
            while not future.done() and (runner := _waiting_runner(span)) is None:
                time.sleep(0.01)
            locked_kb = int(_status(runner, "VmLck").split()[0]) if runner else 0
            if not future.done():
                os.kill(runner, signal.SIGUSR1)
            result = future.result()
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, memlock)
    assert result.status == "ok" and result.stdout.startswith("locked "), result
    assert locked_kb <= MEMLOCK_KB, f"the execution held {locked_kb} KiB of host file pages locked in memory"
