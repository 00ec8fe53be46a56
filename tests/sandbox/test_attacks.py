"""Issue #37's red-team table, one test per class: each attack goes in through the public API and the test asserts
what the host sees afterwards (the secret not in any output, the host keyring unchanged, the process gone, the
neighbours' results, the pool's own counters), never only that nothing raised."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import secrets
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, TestCase

from tests.sandbox import attacks
from tests.sandbox.conftest import assert_no_sandbox_processes, assert_serving, own_pool, run

pytestmark = pytest.mark.xdist_group("sandbox")
x86_64 = pytest.mark.skipif(not attacks.X86_64, reason="raw x86_64 syscall numbers")


def test_secrets_no_host_variable_reaches_the_code(monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("PRIME_HOSTILE_SECRET", secret)  # in the pool's environment when its zygote starts
    with own_pool(uid_base=360_000) as client:
        result = client.execute_sync(ExecRequest(code=attacks.STACK_SCAN, limits=SandboxLimits(wall_s=20)))
        assert result.status == "ok", result
        scanned = int(result.stdout.split()[1])
        assert scanned >= 4096, result.stdout[:500]  # it did read the stack
        assert secret not in result.stdout and "PRIME_HOSTILE_SECRET" not in result.stdout
        environ = result.stdout.rsplit("environ ", 1)[1].strip()
        assert environ == "['HOME', 'LANG', 'PATH', 'TMPDIR', 'USER']", environ
        argv = client.execute_sync(ExecRequest(argv=["sh", "-c", "env; cat /proc/self/environ"]))
        assert secret not in argv.stdout + argv.stderr


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _keyctl(*args) -> int:
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return _libc.syscall(ctypes.c_long(attacks.KEYCTL), *conv)


@x86_64
def test_keyrings_host_session_keyring_is_out_of_reach():
    # A session keyring of this test process's own, holding a secret, which the pool's zygote inherits.
    assert _keyctl(1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING (anonymous)
    value = secrets.token_hex(8).encode()
    add = _libc.syscall(ctypes.c_long(attacks.ADD_KEY), b"user", b"prime-host-secret", value, len(value), -3)
    assert add > 0
    with own_pool(uid_base=362_000) as client:
        result = client.execute_sync(ExecRequest(code=attacks.KEYRING_HOST, limits=SandboxLimits(wall_s=20)))
    assert result.status == "ok", result
    assert value.decode() not in result.stdout, result.stdout
    assert _keyctl(10, -3, b"user", b"prime-planted", 0) < 0  # nothing was added to the host's keyring
    assert "planted -1" in result.stdout  # EPERM: keyctl and add_key are not available inside


@x86_64
def test_keyrings_nothing_carries_over_between_executions(sandbox):
    results = [run(sandbox, attacks.KEYRING_CARRY_WRITE) for _ in range(3)]
    results += [run(sandbox, attacks.KEYRING_CARRY_READ) for _ in range(3)]
    assert all(r.status == "ok" for r in results), results
    assert not any("carried-over" in r.stdout for r in results), [r.stdout for r in results]


def test_wall_clock_holds_when_the_code_closes_its_pipes(sandbox):
    start = time.monotonic()
    result = run(sandbox, attacks.CLOSE_PIPES_AND_SLEEP, limits=SandboxLimits(wall_s=1))
    took = time.monotonic() - start
    assert result.status == "timeout" and "wall time limit of 1.0 s" in result.reason, result
    assert took < 15, took
    assert_no_sandbox_processes(grace_s=2, dying_grace_s=10)  # gone before its uid can be lent again
    assert_serving(sandbox)


@x86_64
def test_memory_everything_the_code_allocates_counts(sandbox):
    limits = SandboxLimits(wall_s=20, memory_mb=64, disk_mb=16)
    for attack in (attacks.MEMFD_HOARD, attacks.SHM_HOARD, attacks.TMPFS_FILL):
        result = run(sandbox, attack, limits=limits)
        assert result.status in ("error", "memory_limit"), (attack[:80], result)
        held = result.stdout.split()
        assert not held or int(held[-1]) < 64, result.stdout
        if result.memory_peak_mb is not None:  # where the pool enforces a memory cgroup
            assert result.memory_peak_mb <= 64 + 16, result.memory_peak_mb
    assert_serving(sandbox)


def test_neighbours_survive_oversized_requests(sandbox):
    before = sandbox.pool.health()
    neighbour = ExecRequest(code="import time\ntime.sleep(1)\nprint('done')", limits=SandboxLimits(wall_s=30))
    big_code = ExecRequest(code="x = 1\n" + "#" * (9 << 20))
    big_stdin = ExecRequest(code="print(1)", stdin="y" * (20 << 20))
    many_tests = ExecRequest(code="x = 1", tests=[TestCase(expr="x", expected=1)] * 5000)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        neighbours = [ex.submit(sandbox.execute_sync, neighbour) for _ in range(4)]
        time.sleep(0.2)
        oversized = [sandbox.execute_sync(r) for r in (big_code, big_stdin, many_tests)]
        done = [f.result(timeout=60) for f in neighbours]
    assert [(r.status, r.stdout) for r in done] == [("ok", "done\n")] * 4, done
    for result, what in zip(oversized, ("code", "stdin", "tests"), strict=True):
        assert result.status == "error" and what in result.reason and "over" in result.reason, result
    after = sandbox.pool.health()
    assert after.zygotes_replaced == before.zygotes_replaced and after.sandbox_errors == before.sandbox_errors
    assert_serving(sandbox)


@x86_64
def test_kernel_surface_is_filtered(sandbox):
    result = run(sandbox, attacks.KERNEL_PROBES)
    assert result.status == "ok", result
    outcomes = dict(line.split() for line in result.stdout.splitlines())
    eperm, enosys, eafnosupport = "-1", "-38", "-97"
    allowed = {eperm, enosys, eafnosupport}
    assert outcomes and all(v in allowed for v in outcomes.values()), outcomes
    assert_serving(sandbox)


def test_integrity_junk_on_the_test_channel_fails_tests_only(sandbox):
    tests = [TestCase(expr="f()", expected=1), TestCase(expr="f() + 1", expected=2)]
    result = run(sandbox, attacks.DEEP_TEST_LINES, tests=tests)
    assert result.status == "ok", result
    # The code's own forged lines come first; the real ones (written after the code ran) win: the code solved it.
    assert [t.passed for t in result.tests] == [True, True], result.tests
    forged_only = run(sandbox, attacks.DEEP_TEST_LINES + "os._exit(0)\n", tests=tests)
    assert forged_only.status != "sandbox_error", forged_only
    assert [t.passed for t in forged_only.tests] == [False, False], forged_only.tests
    # Only the sandbox's own set-up pipe (closed before the code runs) can make a sandbox_error.
    forged_error = run(sandbox, "import os\nos.write(2, b'sandbox: runner set-up failed: x\\n')\nos._exit(71)")
    assert forged_error.status == "error", forged_error


def test_integrity_floats_compare_relative_and_absolute(sandbox):
    cases = [
        TestCase(expr="0.0", expected=4.2e-7),
        TestCase(expr="0.1 + 0.2", expected=0.3),
        TestCase(expr="1e9 + 0.5", expected=1e9),
        TestCase(expr="1.0 + 1e-5", expected=1.0),
        TestCase(expr="1.0 + 1e-5", expected=1.0, rel_tol=1e-4),
        TestCase(expr="__import__('math').sin(__import__('math').pi)", expected=0.0),
    ]
    result = run(sandbox, "", tests=cases)
    assert [t.passed for t in result.tests] == [False, True, True, False, True, True], result.tests


def test_isolation_concurrent_executions_cannot_reach_each_other(sandbox):
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        listener = ex.submit(run, sandbox, attacks.ABSTRACT_LISTEN)
        time.sleep(0.3)
        connector = ex.submit(run, sandbox, attacks.ABSTRACT_CONNECT)
        listened, connected = listener.result(timeout=60), connector.result(timeout=60)
    assert listened.stdout == "nobody came\n", listened
    assert connected.stdout.startswith("refused"), connected
    assert_serving(sandbox)


def test_disk_a_workspace_holds_no_more_than_its_disk_mb(sandbox):
    pool_dir = sandbox.pool.tmp_dir
    ws = asyncio.run(sandbox.open_workspace(disk_mb=16))
    try:
        fill = sandbox.execute_sync(ExecRequest(code=attacks.WORKSPACE_FILL, workspace=ws))
        size = sandbox.execute_sync(ExecRequest(argv=["du", "-sm", "."], workspace=ws))
    finally:
        asyncio.run(sandbox.close_workspace(ws))
    assert fill.status == "error" and "No space left on device" in fill.reason, fill
    assert int(size.stdout.split()[0]) <= 16, size
    on_host = sum(p.stat().st_size for p in pool_dir.rglob("*") if p.is_file())
    assert on_host < 1 << 20, on_host  # nothing of it on the host's disk
    assert_serving(sandbox)


def test_uid_map_sandbox_root_is_not_host_root(sandbox):
    pid = sandbox.pool._zygotes[0].proc.pid
    uid_map = [line.split() for line in Path(f"/proc/{pid}/uid_map").read_text().splitlines()]
    assert all(host != "0" for _, host, _ in uid_map), uid_map
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert all(int(u) != 0 for u in status["Uid"].split()), status["Uid"]
