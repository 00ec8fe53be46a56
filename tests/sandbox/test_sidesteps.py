"""A reward-hacking policy sidestepping the limits that are set per process, or reaching what the sandbox binds in,
beyond ``test_attacks.py``, ``test_redteam.py`` and ``test_containment.py``: each attack goes in through the public
API and the test asserts what the host sees (the status, the CPU the trusted supervisor counted, the files listed)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, TestCase
from prime_orchestrator.sandbox.supervisor import CpuClock

from tests.sandbox.conftest import assert_no_sandbox_processes, assert_serving, own_pool, run

pytestmark = pytest.mark.xdist_group("sandbox")

# limits: RLIMIT_CPU bounds each process alone. Each child burns 0.8 s (under the 1 s limit) and hands on to the next,
# in a chain or {width} at a time; the parent prints the CPU they spent, and waits for all or lets the kernel reap them.
CPU_HANDOFF = """
import os, signal, time
if not {wait}:  # reaped by the kernel: their CPU never reaches the runner's rusage
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
def burn():
    t = time.process_time()
    while time.process_time() - t < 0.8:
        pass
spent = 0.0
for _ in range(8):
    pids = []
    for _ in range({width}):
        r, w = os.pipe()  # one per child, held by it alone: a child that dies before writing is an EOF, not a hang
        pid = os.fork()
        if pid == 0:
            burn()
            os.write(w, b"x")
            os._exit(0)
        os.close(w)
        pids.append((pid, r))
    for pid, r in pids:
        spent += 0.8 * len(os.read(r, 1))
        os.close(r)
        if {wait} and (status := os.waitpid(pid, 0)[1]):
            print("child", os.waitstatus_to_exitcode(status))
print("spent", spent)
"""


@pytest.mark.parametrize(("width", "wait"), [(1, True), (2, True), (2, False)], ids=["chain", "pairs", "orphans"])
def test_limits_cpu_time_counts_every_process_together(sandbox, width, wait):
    # Before: a chain of children each under RLIMIT_CPU spent 6.4 s of CPU in an execution limited to 1 s, which
    # ended "ok" (the orphans' CPU was not even in the reported cpu_s, which counted what the runner reaped).
    if sandbox.pool._cgroups is None or not getattr(sandbox.pool._cgroups, "counts_cpu", True):
        pytest.skip("no cgroup CPU counter on this host: the total is not enforced (the pool says so)")
    limits = SandboxLimits(wall_s=60, cpu_s=1)
    result = run(sandbox, CPU_HANDOFF.format(width=width, wait=wait), limits=limits)
    assert result.status == "timeout" and "CPU time limit of 1.0 s exceeded" in result.reason, result
    # Found past the budget one read late at most. What they spent in all (cpu_s) runs on until the kill lands: on a
    # host loaded beside the tests it was over this bound once (the namespace's init, killed, waits for a CPU to go).
    cpus = len(os.sched_getaffinity(0))
    bound = 1 + CpuClock.GRACE_S + CpuClock.MIN_CHECK_S * cpus + 0.1
    assert 1.0 <= result.cpu_detected_s <= min(bound, result.cpu_s), result
    assert_no_sandbox_processes(grace_s=2)
    within = run(sandbox, CPU_HANDOFF.replace("range(8)", "range(1)").format(width=1, wait=True), limits=limits)
    assert (within.status, within.stdout) == ("ok", "spent 0.8\n"), within  # under the budget: untouched
    assert_serving(sandbox)


def test_limits_no_process_meets_its_own_cpu_limit_under_the_budget(sandbox):
    # Before: RLIMIT_CPU was the budget itself (1 s), which the kernel compares with utime+stime sampled at its ticks,
    # not the precise time the budget counts: on a loaded VM the sample ran ahead, and the "within" child above,
    # burning 0.8 s of process_time, ended at 0.77 s of CPU without writing; its parent waited for the wall limit.
    if sandbox.pool._cgroups is None or not getattr(sandbox.pool._cgroups, "counts_cpu", True):
        pytest.skip("no cgroup CPU counter on this host: RLIMIT_CPU is the only limit (the pool says so)")
    code = "import resource; print(*resource.getrlimit(resource.RLIMIT_CPU))"
    result = run(sandbox, code, limits=SandboxLimits(wall_s=60, cpu_s=1))
    soft, hard = map(int, result.stdout.split())
    assert soft == hard >= CpuClock.BACKSTOP * (1 + CpuClock.GRACE_S), result


@pytest.mark.parametrize(
    ("counter", "seconds"),
    [(b"usage_usec 1500000\nuser_usec 1000000\n", 1.5), (b"2000000000\n", 2.0)],
    ids=["v2", "v1"],
)
def test_limits_the_cpu_counter_of_either_cgroup_version_reads_as_seconds(tmp_path, counter, seconds):
    path = tmp_path / "counter"
    path.write_bytes(b"0\n" if counter[:1].isdigit() else b"usage_usec 0\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        clock = CpuClock(fd, cpu_s=1.5)
        path.write_bytes(counter)
        assert (clock.used(), clock.budget) == (seconds, 2 + CpuClock.GRACE_S)
    finally:
        os.close(fd)


# neighbours: one test line as long as the output limit allows, of elements the judge walked one by one
LONG_TEST_LINE = """
import os
os.write(3, b'{{"i": 0, "value": [' + b"[]," * {n} + b'[]]}}\\n')
os._exit(0)
"""
# what a long line must still bring back: floats matching ints (a float's repr is up to 24 characters), a long
# expected list, and the harness's error of 500 characters that JSON escapes in 12 bytes each
LONG_ANSWERS = """
def near_zero(n):
    return [-1.2345678901234567e-13] * n
def count(n):
    return list(range(n))
def fail():
    raise ValueError("\\U0001f389" * 600)
"""


def test_neighbours_a_long_test_line_is_not_parsed_by_the_pool(sandbox, monkeypatch):
    # Before: the pool parsed the line (0.25 s of json.loads on this VM) and walked its 500,000 elements for their
    # depth (0.6 to 2 s) on its event loop, where every neighbour's verdict waits, for a task expecting [1, 2].
    from prime_orchestrator.sandbox import schemas

    parsed = []
    counting = SimpleNamespace(loads=lambda raw: parsed.append(len(raw)) or json.loads(raw), dumps=json.dumps)
    monkeypatch.setattr(schemas, "json", counting)
    limits = SandboxLimits(wall_s=20, cpu_s=20, output_bytes=1 << 20)
    tests = [TestCase(expr="f()", expected=[1, 2])]
    flood = run(sandbox, LONG_TEST_LINE.format(n=((1 << 20) - 64) // 3), tests=tests, limits=limits)
    assert flood.status == "ok" and flood.pass_fraction == 0.0, flood
    assert max(parsed, default=0) < 20_000, parsed  # the line of 1 MB went unparsed
    parsed.clear()
    answers = [
        TestCase(expr="near_zero(1000)", expected=[0] * 1000),
        TestCase(expr="count(20000)", expected=list(range(20000))),
        TestCase(expr="fail()", expected=None),
    ]
    result = run(sandbox, LONG_ANSWERS, tests=answers, limits=limits)
    assert [t.passed for t in result.tests] == [True, True, False], result.tests
    assert result.tests[2].error.startswith("ValueError: \U0001f389") and len(parsed) == 3, (result.tests[2], parsed)


def test_neighbours_the_depth_of_a_test_line_is_read_from_its_text():
    from prime_orchestrator.sandbox.schemas import MAX_DEPTH, parse_test_lines

    def line(depth: int, inner: str = "0") -> str:
        return '{"i": 0, "value": ' + "[" * depth + inner + "]" * depth + "}"

    assert parse_test_lines(line(MAX_DEPTH), 1) == [{"i": 0, "value": json.loads(line(MAX_DEPTH))["value"]}]
    assert parse_test_lines(line(MAX_DEPTH + 1), 1) == []
    assert parse_test_lines(line(MAX_DEPTH + 1, '"]]]"').replace("[", '{"k": ', 1), 1) == []
    quoted = '{"i": 0, "value": "' + "[" * 500 + '\\"{{"}'  # brackets inside a string are no nesting
    assert parse_test_lines(quoted, 1) == [{"i": 0, "value": "[" * 500 + '"{{'}]
    assert parse_test_lines('{"i": 0, "value": ' + "[" * 200 + "}", 1) == []


def _host_listeners() -> dict[str, tuple[socket.socket, object]]:
    """What a run serves on the host beside its TCP ports: the inference server over IPv6 loopback, a metrics or
    zmq peer over UDP, a local service on an abstract unix socket (no file to hide: any process of the host's
    network namespace reaches it)."""
    tcp6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    tcp6.bind(("::1", 0))
    tcp6.listen()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0prime-host-{secrets.token_hex(4)}"
    abstract.bind(name)
    abstract.listen()
    for s in (tcp6, udp, abstract):
        s.setblocking(False)
    return {"tcp6": (tcp6, tcp6.getsockname()[1]), "udp": (udp, udp.getsockname()[1]), "abstract": (abstract, name)}


REACH_HOST = """
import socket
for kind, family, type_, address in {targets!r}:
    s = socket.socket(family, type_)
    s.settimeout(1)
    try:
        s.connect(address)
        s.sendall(b"update_weights")
        print(kind, "reached")
    except OSError as e:
        print(kind, e.errno)
"""


def test_network_no_host_service_over_ipv6_udp_or_an_abstract_socket(sandbox):
    listeners = _host_listeners()
    targets = [
        ("tcp6", int(socket.AF_INET6), int(socket.SOCK_STREAM), ("::1", listeners["tcp6"][1])),
        ("udp", int(socket.AF_INET), int(socket.SOCK_DGRAM), ("127.0.0.1", listeners["udp"][1])),
        ("abstract", int(socket.AF_UNIX), int(socket.SOCK_STREAM), listeners["abstract"][1].encode()),
    ]
    try:
        result = run(sandbox, REACH_HOST.format(targets=targets))
        outcomes = dict(line.split() for line in result.stdout.splitlines())
        refused = {"tcp6": errno.EADDRNOTAVAIL, "udp": errno.ENETUNREACH, "abstract": errno.ECONNREFUSED}
        assert result.status == "ok" and outcomes == {k: str(v) for k, v in refused.items()}, result
        for kind, (s, _) in listeners.items():
            with pytest.raises(BlockingIOError):  # nothing connected, nothing arrived
                s.recv(64) if kind == "udp" else s.accept()
    finally:
        for s, _ in listeners.values():
            s.close()
    assert_serving(sandbox)


def _dirty_pages(path: Path) -> int:
    """Pages of ``path`` the host's page cache holds dirty (``cachestat``, Linux 6.5; the same number everywhere)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    span, stat = (ctypes.c_uint64 * 2)(0, 0), (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(ctypes.c_long(451), fd, span, stat, 0) != 0:
            pytest.skip(f"no cachestat here ({os.strerror(ctypes.get_errno())})")
    finally:
        os.close(fd)
    return stat[1]


# host files: every call that writes back a file, on a read-only descriptor of a bound host file; {path} is it
SYNC_BOUND_FILE = """
import ctypes, mmap, os
fd = os.open({path!r}, os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
calls = {{
    "fsync": lambda: os.fsync(fd),
    "fdatasync": lambda: os.fdatasync(fd),
    "sync_file_range": lambda: libc.sync_file_range(fd, ctypes.c_long(0), ctypes.c_long(0), 7),  # wait, write, wait
    "msync": lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ).flush(),
}}
for name, call in calls.items():
    print(name, call())
"""


def test_host_files_syncing_a_bound_file_writes_back_nothing_of_the_host():
    # Before: fsync on a read-only descriptor of a bound host file wrote back the host's dirty data of that file (all
    # 65,536 dirty pages of a 256 MiB checkpoint being written, the execution waiting 0.16 s for it, uninterruptibly)
    # and committed the host filesystem's journal; sync_file_range and msync(MS_SYNC) wrote its data back too.
    folder = Path(tempfile.mkdtemp(prefix="prime-bound-", dir="/var/tmp"))  # a disk, not a tmpfs
    try:
        folder.chmod(0o755)
        checkpoint = folder / "checkpoint.bin"
        with open(checkpoint, "wb") as f:  # written, not synced: what a trainer's checkpoint is for a while
            f.write(os.urandom(1 << 20) * 64)
        before = _dirty_pages(checkpoint)
        if before == 0:
            pytest.skip(f"{folder} keeps no dirty pages (tmpfs, or written back already)")
        with own_pool(uid_base=364_000, ro_paths=[str(folder)]) as client:
            code = SYNC_BOUND_FILE.format(path=str(checkpoint))
            result = client.execute_sync(ExecRequest(code=code, limits=SandboxLimits(wall_s=20)))
        assert result.status == "ok", result
        assert result.stdout.split() == ["fsync", "None", "fdatasync", "None", "sync_file_range", "0", "msync", "None"]
        assert _dirty_pages(checkpoint) >= before * 0.9, before  # the host's flusher alone may have begun on it
    finally:
        shutil.rmtree(folder)


HUGE_PAGES = Path("/proc/sys/vm/nr_hugepages")
# memory: anonymous huge pages from the host's reserve, 2 MiB each, until refused; how many it held
HUGETLB_HOARD = """
import mmap
held = []
for _ in range(64):
    try:
        held.append(mmap.mmap(-1, 2 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000))  # MAP_HUGETLB
        held[-1][0:1] = b"x"
    except OSError as e:
        print("refused", e.errno)
        break
print("held", len(held))
"""


def _free_huge_pages() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["HugePages_Free"])


@pytest.fixture
def reserved_huge_pages():
    """Huge pages reserved on the host for the test (what an inference or DPDK host keeps), restored after."""
    before = HUGE_PAGES.read_text()
    if int(before) == 0:
        HUGE_PAGES.write_text("32")
    try:
        if _free_huge_pages() < 8:
            pytest.skip("no huge pages could be reserved on this host")
        yield
    finally:
        HUGE_PAGES.write_text(before)


def test_memory_the_hosts_reserved_huge_pages_are_out_of_reach(sandbox, reserved_huge_pages):
    # Before: the memory cgroup does not count hugetlb pages; an execution limited to 64 MiB held 22 of the host's
    # 32 (RLIMIT_AS stopped it, per process: 16 processes of 512 MiB would take 4,096), its memory_peak_mb 1.5.
    free = _free_huge_pages()
    result = run(sandbox, HUGETLB_HOARD, limits=SandboxLimits(wall_s=20, memory_mb=64, disk_mb=16))
    assert result.status == "ok" and result.stdout.split() == ["refused", str(errno.ENOMEM), "held", "0"], result
    assert _free_huge_pages() == free


@pytest.mark.timeout(120)
def test_neighbours_unclosed_strings_cost_the_depth_check_one_pass():
    # Each quote of a text of unclosed strings started a scan to its end: 16 KB took the check 2.9 s (quadratic), and
    # a line within a task's longest_line reaches it. Linear now: this 1.6 MB line, hours then, takes milliseconds.
    from prime_orchestrator.sandbox.schemas import parse_test_lines

    line = '{"i": 0, "value": ' + "[" * 200 + '"\\' * 800_000 + "\\"
    assert parse_test_lines(line, 1) == []


def test_limits_a_cpuacct_hierarchy_the_pool_cannot_use_leaves_memory_and_pids_enforced(tmp_path):
    from prime_orchestrator.sandbox.cgroups import Cgroups

    for controller in ("memory", "pids"):
        (tmp_path / controller).mkdir()
    # no cpuacct hierarchy there
    parents = {c: tmp_path / c / "shared" / "pool" for c in ("memory", "pids", "cpuacct")}
    cgroups, why = Cgroups._make(1, parents)
    assert cgroups is not None and set(cgroups.parents) == {"memory", "pids"} and not cgroups.counts_cpu, why
    cgroups.close()


@pytest.mark.parametrize("mounted_with_cpuacct", [True, False])
def test_neighbours_a_cpu_hierarchy_the_pool_cannot_use_is_not_enforced_but_named(tmp_path, mounted_with_cpuacct):
    from prime_orchestrator.sandbox.cgroups import Cgroups

    for controller in ("memory", "pids"):
        (tmp_path / controller).mkdir()
    # no cpu(acct) hierarchy there
    parents = {c: tmp_path / c / "shared" / "pool" for c in ("memory", "pids", "cpuacct")}
    cpu = parents["cpuacct"] if mounted_with_cpuacct else tmp_path / "cpu" / "shared" / "pool"
    if not mounted_with_cpuacct:
        parents["cpu"] = cpu
    cgroups, why = Cgroups._make(1, parents, cpu)
    assert cgroups is not None and set(cgroups.parents) == {"memory", "pids"} and cgroups.cpu_parent is None, why
    assert cgroups.place_zygote(os.getpid()) == "no cpu cgroup hierarchy"
    cgroups.close()


# host files: whether the host's page cache holds a bound host file, read without blocking (preadv2 with RWF_NOWAIT
# answers EAGAIN for a page that is not cached), the probe mincore and cachestat were denied for; {paths} are bound
# host files, one the host just read and one it evicted
PAGE_CACHE_NOWAIT = """
import os
for path in {paths!r}:
    fd = os.open(path, os.O_RDONLY)
    for name, flags in (("nowait", os.RWF_NOWAIT), ("plain", 0)):
        try:
            print(name, os.preadv(fd, [bytearray(4096)], 0, flags))
        except OSError as e:
            print(name, -e.errno)
"""


def test_host_files_no_page_cache_probe_by_a_read_that_never_waits(sandbox):
    # Before: preadv2(RWF_NOWAIT) read 4096 bytes of the stdlib module the host had just read and -EAGAIN of the one
    # it had evicted: which host files the host and the neighbours use, as mincore told before it was denied.
    stdlib = sorted(Path(os.__file__).resolve().parent.glob("*.py"), key=lambda p: p.stat().st_size)
    hot, cold = stdlib[-1], stdlib[-2]
    hot.read_bytes()
    fd = os.open(cold, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    result = run(sandbox, PAGE_CACHE_NOWAIT.format(paths=[str(hot), str(cold)]))
    assert result.status == "ok", result
    no_wait = f"nowait {-errno.EOPNOTSUPP}"  # what a file that cannot be read without waiting answers
    assert result.stdout.splitlines() == [no_wait, "plain 4096"] * 2, result.stdout


# neighbours: 8 processes spinning for 3 s on one CPU, each in a session of its own (subprocess's
# start_new_session does the same); {cpu} is the CPU a host process spins on meanwhile, in its own session
SESSIONS_SPIN = """
import os, time
os.sched_setaffinity(0, {{{cpu}}})
pids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        os.setsid()
        end = time.monotonic() + 3
        while time.monotonic() < end:
            pass
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
"""
HOST_SPIN = "import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.monotonic() + 3\nwhile time.monotonic() < end:\n    pass\nprint(time.process_time())\n"


def test_neighbours_sessions_of_the_code_take_a_host_process_no_more_cpu_than_one(sandbox):
    # Before: in the root CPU cgroup each session is an autogroup weighing as much as a whole host session (the
    # trainer's, the inference server's, every other execution's together): the 8 sessions' execution took 2.74 s
    # of CPU to the host process's 0.36 s on their shared core (7.6 times; 1.0 without setsid).
    if "one CPU weight per execution" in " ".join(sandbox.pool.health().unenforced):
        pytest.skip("no cpu cgroup here")
    cpu = min(os.sched_getaffinity(0))
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_SPIN.format(cpu=cpu)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    result = run(sandbox, SESSIONS_SPIN.format(cpu=cpu), limits=SandboxLimits(wall_s=30, cpu_s=30))
    host_cpu = float(host.communicate(timeout=60)[0])
    assert result.status == "ok", result
    assert result.cpu_s < 3 * host_cpu, (result.cpu_s, host_cpu)


# neighbours: 16 processes spinning on one CPU until the limits stop them, and a neighbour needing 1 s of CPU there
SPIN_16 = """
import os
os.sched_setaffinity(0, {{{cpu}}})
for _ in range(15):
    if os.fork() == 0:
        break
while True:
    pass
"""
ONE_SECOND = """
import os, time
os.sched_setaffinity(0, {{{cpu}}})
start = time.process_time()
while time.process_time() - start < 1.0:
    pass
print("done")
"""


def test_neighbours_an_execution_of_many_processes_leaves_each_neighbour_its_share(sandbox):
    # Before: the CPU went per process, so two executions of 16 spinning processes left a neighbour 1/33 of their
    # core: it spent 0.12 s of CPU in its 5 s and timed out (alone it took 1.1 s), a 0 for a correct answer.
    if "one CPU weight per execution" in " ".join(sandbox.pool.health().unenforced):
        pytest.skip("no cpu cgroup here")
    cpu = min(os.sched_getaffinity(0))
    limits = SandboxLimits(wall_s=10, cpu_s=10)

    async def together():
        spin = ExecRequest(code=SPIN_16.format(cpu=cpu), limits=limits)
        work = ExecRequest(code=ONE_SECOND.format(cpu=cpu), limits=limits)
        return await asyncio.gather(sandbox.execute(spin), sandbox.execute(spin), sandbox.execute(work))

    *spinners, neighbour = sandbox.call(together()).result(timeout=120)
    assert [s.status for s in spinners] == ["timeout", "timeout"], spinners
    assert (neighbour.status, neighbour.stdout) == ("ok", "done\n"), neighbour
