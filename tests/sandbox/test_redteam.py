"""A reward-hacking policy against the grade, the limits and the neighbours, beyond issue #37's table
(``test_attacks.py``): each attack goes in through the public API and the test asserts what the host sees (the
reward, the status, the time it took, the node still answering), never only that nothing raised."""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import secrets
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, SandboxClient, TestCase

from tests.sandbox import attacks
from tests.sandbox.conftest import FAST, assert_no_sandbox_processes, assert_serving, run, sandbox_pids

pytestmark = pytest.mark.xdist_group("sandbox")


def _hidden_tests() -> list[TestCase]:
    """Two tests whose answers the code cannot know: a random int and a random string."""
    return [
        TestCase(expr="solve(1)", expected=secrets.randbelow(10**9) + 2000),
        TestCase(expr="solve(2)", expected=secrets.token_hex(8)),
    ]


def test_grade_values_the_judge_cannot_compare_fail_their_test(sandbox):
    # Before: math.isclose(10**400, 0.5) raised OverflowError in the pool, so execute() raised in the caller.
    floats = [TestCase(expr="solve(1)", expected=0.5), TestCase(expr="10 ** 400", expected=1.5)]
    result = run(sandbox, attacks.HUGE_INT, tests=floats)
    assert result.status == "ok" and result.pass_fraction == 0.0, result
    huge = run(sandbox, "def solve(x):\n    return 1.5\n", tests=[TestCase(expr="solve(1)", expected=10**400)])
    assert huge.status == "ok" and huge.pass_fraction == 0.0, huge
    exact = run(sandbox, "", tests=[TestCase(expr="10 ** 400", expected=10**400), TestCase(expr="2.0", expected=2)])
    assert exact.pass_fraction == 1.0, exact


def test_grade_lone_surrogates_fail_their_test_through_a_node(node, monkeypatch):
    # Before: the node could not encode the result (HTTP 500), which the client reports as a sandbox_error.
    monkeypatch.setenv("NODE_KEY", node.key)
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    tests = [TestCase(expr="solve(1)", expected={"k": "v"}), TestCase(expr="solve(2)", expected=["x"])]
    try:
        returned = client.execute_sync(ExecRequest(code=attacks.LONE_SURROGATE, tests=tests))
        forged = client.execute_sync(ExecRequest(code=attacks.FORGED_SURROGATE_ERROR, tests=tests))
        after = client.execute_sync(ExecRequest(code="print(6 * 7)"))
    finally:
        client.close()
    assert returned.status == "ok" and returned.pass_fraction == 0.0, returned
    assert returned.tests[0].got == {"k\ufffd\ufffd\ufffd": "v\ufffd\ufffd\ufffd"}, returned.tests[0]
    assert forged.status == "ok" and forged.pass_fraction == 0.0, forged
    assert forged.tests[0].error == "\ufffd\ufffd\ufffd" and forged.tests[1].got == ["\ufffd\ufffd\ufffd"], forged
    assert (after.status, after.stdout) == ("ok", "42\n"), after


@pytest.mark.parametrize("trick", sorted(attacks.FORGE_TRICKS))
def test_grade_harness_tricks_earn_nothing(sandbox, trick):
    tests = _hidden_tests()
    result = run(sandbox, attacks.FORGE_TRICKS[trick], tests=tests)
    assert result.status != "sandbox_error", result
    assert result.pass_fraction == 0.0, (trick, result.tests)
    answers = {1: tests[0].expected, 2: tests[1].expected}
    honest = run(sandbox, f"def solve(x):\n    return {answers!r}[x]\n", tests=tests)  # the same tests can pass
    assert honest.pass_fraction == 1.0, honest


def test_grade_expected_values_are_nowhere_the_code_can_look(sandbox):
    in_expr, expected = secrets.token_hex(16), secrets.token_hex(16)
    tests = [TestCase(expr=f"solve({in_expr!r})", expected=expected)]
    result = run(sandbox, attacks.HEX_TOKENS + "def solve(x):\n    return x\n", tests=tests)
    assert result.status == "ok", result
    assert in_expr in result.stdout  # the scan reaches the test expressions the harness holds
    assert expected not in result.stdout and expected not in result.stderr
    assert result.pass_fraction == 0.0


def test_limits_cpu_threads_ignoring_signals_are_stopped_at_the_cpu_limit(sandbox):
    start = time.monotonic()
    limits = SandboxLimits(wall_s=30, cpu_s=1)
    result = run(sandbox, attacks.CPU_THREADS_IGNORING_SIGNALS, limits=limits)
    took = time.monotonic() - start
    assert result.status == "timeout" and "CPU time limit of 1.0 s" in result.reason, result
    assert result.cpu_s < 2.5 and took < 10, (result.cpu_s, took)
    assert_no_sandbox_processes(grace_s=2)


def test_limits_the_test_channel_counts_toward_the_output_limit(sandbox):
    start = time.monotonic()
    result = run(sandbox, attacks.TEST_CHANNEL_FLOOD, tests=[TestCase(expr="1", expected=1)])
    assert result.status == "output_limit" and time.monotonic() - start < 10, result.reason
    assert result.pass_fraction == 0.0
    assert_serving(sandbox)


def test_neighbours_no_realtime_priority_and_no_core_dump(sandbox):
    # The runner's RLIMIT_RTPRIO and RLIMIT_NICE were inherited from the pool's process (0 on this host, up to 99
    # and 40 on others), and its dumpable flag from the host's fs.suid_dumpable (2 where apport is installed).
    result = run(sandbox, attacks.REALTIME)
    assert result.status == "ok", result
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["rlimits"] == "[(0, 0), (0, 0), (1, 1)]" and lines["dumpable"] == "0", lines
    assert lines["fifo"] == "1" and lines["nice"] == "13", lines  # EPERM, EACCES
    crash = run(sandbox, "import ctypes\nctypes.string_at(0)")
    assert crash.status == "error" and "SIGSEGV" in crash.reason, crash
    assert_serving(sandbox)


def test_neighbours_the_hosts_oom_killer_takes_sandbox_processes_first(sandbox):
    # A pool's limits add up to more than most hosts hold (256 x 576 MiB by default; this VM has 24 GiB): executions
    # each within its cgroup can run the host out of memory, and the kernel then kills the process with the most
    # memory, the trainer or the inference server, unless the sandbox's processes are marked as first to go.
    future = sandbox.call(sandbox.pool.execute(ExecRequest(code="import time\ntime.sleep(3)")))
    deadline = time.monotonic() + 20
    while not (pids := sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.02)
    zygote = sandbox.pool._zygotes[0].proc.pid
    adjust = {pid: Path(f"/proc/{pid}/oom_score_adj").read_text().strip() for pid in [zygote, *pids]}
    assert future.result(timeout=30).status == "ok"
    assert pids and set(adjust.values()) == {"1000"}, adjust


def test_secrets_of_the_interpreters_prefix_only_bin_and_lib_are_bound(sandbox):
    # The pool bound the binary's grandparent whole: for an interpreter in $HOME/bin, the home with ~/.ssh in it.
    prefix = Path(sys.executable).resolve().parent.parent
    if prefix == Path("/usr") or not (set(os.listdir(prefix)) - {"bin", "lib", "lib64"}):
        pytest.skip(f"nothing but the interpreter in its prefix {prefix}")
    result = run(sandbox, f"import os\nprint(sorted(os.listdir({str(prefix)!r})))")
    assert result.stdout.strip() == str(sorted(d for d in ("bin", "lib", "lib64") if (prefix / d).is_dir())), result


def test_neighbours_a_megabyte_of_test_lines_costs_the_pool_a_few_parses(monkeypatch):
    # Every line the code wrote was parsed on the pool's loop: 1 MiB of small lines, 0.2 s in which no neighbour's
    # verdict was read (32 such executions took a neighbour's latency from 6 ms to 1.3 s on the 2-core VM).
    from prime_orchestrator.sandbox import schemas

    parsed = []
    counting = SimpleNamespace(loads=lambda raw: parsed.append(raw) or json.loads(raw), dumps=json.dumps)
    monkeypatch.setattr(schemas, "json", counting)
    flood = '{"i": 0, "value": 7}\n' * 50_000
    harness = '{"i": 0, "value": 1}\n{"i": 1, "error": "ZeroDivisionError"}\n'
    tests = [TestCase(expr="f(0)", expected=1), TestCase(expr="f(1)", expected=2)]
    outcomes = schemas.judge(tests, schemas.parse_test_lines(flood + harness, len(tests)))
    assert [o.passed for o in outcomes] == [True, False] and len(parsed) == 2, (outcomes, len(parsed))
    parsed.clear()
    after_harness = schemas.parse_test_lines(harness + "junk\n" * 50_000, len(tests))  # only the code writes there
    assert after_harness == [] and len(parsed) == 4 * len(tests) + 64


def _bound_host_file() -> Path:
    """The largest module of the interpreter's stdlib: a host file bound read-only into every execution, at its path."""
    return max(Path(os.__file__).resolve().parent.glob("*.py"), key=lambda p: p.stat().st_size)


def _resident_pages(path: Path) -> int:
    """How many pages of ``path`` the host's page cache holds (mincore of a shared mapping, from the host)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
    finally:
        libc.munmap(address, size)
    return sum(v & 1 for v in vec)


def test_host_files_a_lock_on_a_bound_file_never_blocks_the_host(sandbox):
    # flock on a read-only bind locks the host's inode: a host process taking the same lock waited (here it was
    # refused ~300 times in the 2 s the execution held it). POSIX locks stay: read-only, they can only be read locks.
    path = _bound_host_file()
    code = attacks.HOST_FILE_LOCK.format(path=str(path))
    future = sandbox.call(sandbox.pool.execute(ExecRequest(code=code, limits=FAST)))
    refused, fd = 0, os.open(path, os.O_RDONLY)
    try:
        while not future.done():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                refused += 1
            time.sleep(0.01)
    finally:
        os.close(fd)
    result = future.result(timeout=60)
    assert (result.status, refused) == ("ok", 0), (result, refused)
    assert result.stdout == "flock 38\n", result  # ENOSYS: a lock library gives up at once instead of retrying


@pytest.mark.skipif(not attacks.X86_64, reason="raw x86_64 syscall numbers")
def test_host_files_no_watches_page_cache_probes_or_evictions(sandbox):
    # inotify and dnotify watched the bound files (when the host and the neighbours read them), mincore probed their
    # pages in the host's page cache, and fadvise(DONTNEED) emptied it: every page of the file, gone for the host.
    path = _bound_host_file()
    path.read_bytes()
    before = _resident_pages(path)
    result = run(sandbox, attacks.HOST_FILE_PROBES.format(path=str(path)))
    assert result.status == "ok", result
    assert _resident_pages(path) >= before > 0, result.stdout
    outcomes = dict(line.split() for line in result.stdout.splitlines())
    assert outcomes and set(outcomes.values()) == {"-1"}, outcomes  # EPERM


def test_host_files_graded_code_still_runs_with_its_own_files(sandbox):
    result = run(sandbox, attacks.OWN_FILES)
    assert result.status == "ok", result
    assert result.stdout.splitlines() == [
        "sqlite 4950",
        "memory 42",
        "locks ok",
        "shelf [1, 2]",
        "unittest 0 OK",
    ], result


def test_neighbours_output_json_escapes_cost_the_host_its_bytes_not_six_times(sandbox, monkeypatch):
    # An invalid byte went to the pool as "\\ufffd" and a control character as "\\u0001": a megabyte of either
    # made a 6 MB verdict, which the pool parsed on its loop (14 ms) and a node serialised again (42 ms).
    from prime_orchestrator.sandbox import pool

    verdicts = []
    recording = SimpleNamespace(loads=lambda raw: verdicts.append(len(raw)) or json.loads(raw), dumps=json.dumps)
    monkeypatch.setattr(pool, "json", recording)
    cap = 256 << 10
    bound = cap * 3 // 2 + 4096
    limits = SandboxLimits(wall_s=20, cpu_s=20, output_bytes=cap)
    tests = [TestCase(expr="solve()", expected=42)]
    for n in (cap - 4096, cap // 3 - 4096, cap * 2):
        result = run(sandbox, attacks.ESCAPED_OUTPUT.format(n=n), limits=limits, tests=tests)
        assert result.status == ("ok" if 3 * n < cap else "output_limit"), result.reason
        assert verdicts[-1] <= bound and len(result.model_dump_json().encode()) <= bound, (n, verdicts)
        if 3 * n < cap:  # the harness's line, written last, is kept
            assert result.pass_fraction == 1.0, result.tests
    text = 'h\u00e9llo w\u00f6rld \u2713 \U0001f389\t"q" \x1b[1mbold\x1b[0m\n' * (cap // 2 // 40)
    code = f"import sys\nsys.stdout.write({text!r})\nsys.stderr.write({text[:4000]!r})\n"
    valid = run(sandbox, code, limits=limits)
    assert (valid.status, valid.stdout, valid.stderr) == ("ok", text, text[:4000]), valid.reason
    assert verdicts[-1] <= bound, verdicts
