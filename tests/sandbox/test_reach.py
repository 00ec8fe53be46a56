"""The fifth red-team pass: host services behind a bound path, other uids' processes, newer kernel calls, output and
processes at full speed. Each attack goes in through the public API; each test asserts what the host sees."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, cgroups

from tests.sandbox import attacks
from tests.sandbox.conftest import MAX_CONCURRENCY, UID_BASE, assert_serving, own_pool, run

pytestmark = pytest.mark.xdist_group("sandbox")
x86_64 = pytest.mark.skipif(not attacks.X86_64, reason="x86_64 syscall numbers")

CONNECT = """
import socket
for path in {paths!r}:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.sendall(b"from the sandbox")
        print(path, "sent")
    except OSError as e:
        print(path, type(e).__name__)
print(open({plain!r}).read())
"""


def test_host_files_a_host_socket_in_a_bound_path_takes_nothing_from_the_code():
    # A read-only bind does not stop connect(), and the network namespace only separates abstract names: a host
    # service listening on a socket of mode 0777 under pool.ro_paths took the code's bytes. The zygote now covers
    # every socket under pool.ro_paths with /dev/null (nodev) when it starts.
    shared = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pool.ro_paths are outside /tmp
    try:
        _connect_from_inside(shared)
    finally:
        shutil.rmtree(shared)


def _connect_from_inside(shared: Path) -> None:
    os.chmod(shared, 0o755)
    (shared / "sub").mkdir(mode=0o755)
    (shared / "data.txt").write_text("still readable")
    servers = []
    for path in (shared / "svc.sock", shared / "sub" / "deep.sock"):
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen(4)
        server.setblocking(False)  # a connection completes in the backlog, its bytes wait there
        servers.append(server)
    paths = [str(shared / "svc.sock"), str(shared / "sub" / "deep.sock")]
    code = CONNECT.format(paths=paths, plain=str(shared / "data.txt"))
    with own_pool(uid_base=4_500_000, max_concurrency=1, ro_paths=[str(shared)]) as client:
        result = client.execute_sync(ExecRequest(code=code, limits=SandboxLimits(wall_s=10, cpu_s=10)))
    received = []
    for server in servers:
        with contextlib.suppress(BlockingIOError):
            received.append(server.accept()[0].recv(100))
        server.close()
    assert received == [], f"a host service under a bound path got {received}"
    assert result.status == "ok" and "sent" not in result.stdout, result
    assert result.stdout.endswith("still readable\n"), result  # the rest of the path is bound as before


PROBE_OTHERS = (
    attacks._LIBC
    + """
uids = [0, *range({base}, {top})]
for uid in uids:
    sys_(141, 2, uid, 19)  # setpriority(PRIO_USER, uid, 19)
    sys_(251, 3, uid, (3 << 13) | 7)  # ioprio_set(IOPRIO_WHO_USER, uid, IOPRIO_CLASS_IDLE)
limits = (ctypes.c_ulong * 2)(8, 8)
mask = ctypes.c_ulong(1)
for pid in range(2, 4096):
    sys_(141, 0, pid, 19)  # setpriority(PRIO_PROCESS, pid, 19)
    sys_(302, pid, 7, ctypes.addressof(limits), 0)  # prlimit64(pid, RLIMIT_NOFILE, {{8, 8}})
    sys_(203, pid, 8, ctypes.addressof(mask))  # sched_setaffinity(pid, {{CPU 0}})
print("own_nice", sys_(141, 0, 0, 19), os.getpriority(os.PRIO_PROCESS, 0))
try:
    print("workspaces", os.listdir("/.ws"))  # every workspace of the zygote is mounted under it
except OSError as e:
    print("workspaces", -e.errno)
args = (ctypes.c_uint64 * 11)(0x10000000 | 0x20000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
print("clone3_newuser", sys_(435, ctypes.addressof(args), 88))
args[0] = 0
print("clone3_plain", sys_(435, ctypes.addressof(args), 88))
attr = (ctypes.c_uint32 * 14)(56, 6, 0, 0, 0, 0, 10**6, 0, 10**7, 0, 10**7, 0, 0, 0)  # runtime 1 ms of 10
print("sched_deadline", sys_(314, 0, ctypes.addressof(attr), 0))  # sched_setattr(self, SCHED_DEADLINE)
import fcntl
fd = os.open("/usr/bin/env", os.O_RDONLY)
try:
    fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)  # F_SETLEASE on a bound host file
    print("lease", 0)
except OSError as e:
    print("lease", -e.errno)
"""
)


def _as_uid(uid: int) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], user=uid, group=uid)


def _open_files(pid: int) -> str:
    return next(line for line in open(f"/proc/{pid}/limits") if line.startswith("Max open files"))


def _ioprio(pid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(252, 1, pid)  # ioprio_get(IOPRIO_WHO_PROCESS, pid)


@x86_64
def test_neighbours_priority_limits_and_cpus_of_other_uids_are_out_of_reach(sandbox):
    # setpriority and ioprio_set by user walk every process of a uid, prlimit64 and sched_setaffinity take any pid:
    # aimed at host processes of the zygotes' uid, of every slot's and at root's (and at pids 2-4095), none may change.
    # And the zygote's workspaces, each mounted under /.ws in every execution's mount namespace: not listed.
    victims = [_as_uid(uid) for uid in (UID_BASE, UID_BASE + 1, UID_BASE + 2, UID_BASE + MAX_CONCURRENCY)]
    victims.append(subprocess.Popen(["sleep", "60"]))  # root's
    try:
        before = [
            (os.getpriority(os.PRIO_PROCESS, v.pid), _ioprio(v.pid), _open_files(v.pid),
             os.sched_getaffinity(v.pid)) for v in victims
        ]  # fmt: skip
        code = PROBE_OTHERS.format(base=UID_BASE, top=UID_BASE + MAX_CONCURRENCY + 2)
        result = run(sandbox, code)
        after = [
            (os.getpriority(os.PRIO_PROCESS, v.pid), _ioprio(v.pid), _open_files(v.pid),
             os.sched_getaffinity(v.pid)) for v in victims
        ]  # fmt: skip
    finally:
        for v in victims:
            v.kill()
            v.wait()
    assert result.status == "ok", result
    assert after == before, "a host process of another uid was changed from inside"
    probes = dict(line.split(maxsplit=1) for line in result.stdout.splitlines())
    assert probes["own_nice"] == "0 19" and probes["workspaces"] == "-13", (
        probes
    )  # the calls themselves work: on the execution's own processes
    enosys, eperm = "-38", "-1"
    assert (probes["clone3_newuser"], probes["clone3_plain"]) == (enosys, enosys), probes  # libc falls back to clone
    assert probes["sched_deadline"] == eperm and probes["lease"] in ("-13", "-11"), probes
    assert_serving(sandbox)


def test_limits_output_at_full_speed_costs_the_host_less_than_the_code(sandbox):
    # Three threads writing one byte per call to stdout, stderr and the test channel: each write wakes the supervisor,
    # whose CPU (in the zygotes' CPU cgroup, not the execution's budget) is what the host pays for it.
    code = (
        "import os, threading\ndef w(fd):\n    while True:\n        os.write(fd, b'x')\n"
        "for fd in (2, 3):\n    threading.Thread(target=w, args=(fd,)).start()\nw(1)\n"
    )
    limits = SandboxLimits(wall_s=10, cpu_s=10, output_bytes=128 << 10)
    result = run(sandbox, code, limits=limits)
    assert result.status == "output_limit" and result.wall_s < 8, result
    assert result.supervisor_cpu_s < result.cpu_s + 0.05, (result.supervisor_cpu_s, result.cpu_s)


FORK_TO_THE_LIMIT = """
import os, threading, time
kids = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        kids += 1
except OSError:
    pass
try:
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        kids += 1
except RuntimeError:
    pass
print(kids, flush=True)
time.sleep(60)
"""


def test_neighbours_processes_to_the_limit_leave_the_host_and_a_neighbour_theirs(sandbox):
    # Four executions holding every process and thread their limit allows until their wall limit, while a neighbour
    # runs and the host starts a process: the limit holds for each, the neighbour and the host are served.
    limits = SandboxLimits(wall_s=3, cpu_s=3, processes=32)

    async def together():
        holders = [asyncio.ensure_future(sandbox.execute(ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)))]
        holders += [asyncio.ensure_future(sandbox.execute(ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)))]
        holders += [asyncio.ensure_future(sandbox.execute(ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)))]
        holders += [asyncio.ensure_future(sandbox.execute(ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)))]
        await asyncio.sleep(1.0)
        started = time.monotonic()
        host = await asyncio.to_thread(subprocess.run, ["true"], timeout=10)
        host_s = time.monotonic() - started
        neighbour = await sandbox.execute(ExecRequest(code="print(sum(range(10**5)))", limits=limits))
        return await asyncio.gather(*holders), neighbour, host.returncode, host_s

    holders, neighbour, host_rc, host_s = sandbox.call(together()).result(timeout=60)
    assert (neighbour.status, neighbour.stdout) == ("ok", "4999950000\n"), neighbour
    assert host_rc == 0 and host_s < 2, host_s
    for h in holders:
        assert h.status == "timeout" and 0 < int(h.stdout) < 32, h  # the runner itself is one of the 32
    assert_serving(sandbox)


def test_neighbours_the_executions_together_hold_at_most_the_pools_share_of_the_hosts_tasks(monkeypatch):
    # Each execution's pids cgroup bounds it alone: max_concurrency x processes may add up to more than the host's
    # pid space (512 x 64 is all of this VM's 32,768), and then every fork and thread start on the host failed. The
    # pool's own pids cgroup now holds half the host's tasks; here that half is 48, against 4 x 32 (on a shared
    # cgroup of the test's own: the real one bounds every other pool of this host).
    monkeypatch.setattr(cgroups, "task_cap", lambda: 48, raising=False)
    monkeypatch.setattr(cgroups, "SHARED", f"prime-sandbox-test-{os.getpid()}")
    limits = SandboxLimits(wall_s=2, cpu_s=2, processes=32)
    with own_pool(uid_base=4_600_000, max_concurrency=4) as client:
        if client.pool._cgroups is None:
            pytest.skip("no pids cgroup on this host")

        async def together():
            request = ExecRequest(code=FORK_TO_THE_LIMIT, limits=limits)
            return await asyncio.gather(*(client.pool.execute(request) for _ in range(4)))

        holders = client.call(together()).result(timeout=60)
    assert all(h.status == "timeout" for h in holders), holders
    held = [int(h.stdout) + 1 for h in holders]  # each runner is one of them
    assert sum(held) <= 48, f"the executions held {held} tasks together"
