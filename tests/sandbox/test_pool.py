"""The direct API of the sandbox pool: results, tests judged on the host, stdin, argv, limits, workspaces."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest, TestCase
from prime_orchestrator.sandbox.schemas import judge, values_match

from tests.sandbox.conftest import assert_serving, run, sandbox_pids

pytestmark = pytest.mark.xdist_group("sandbox")

SOLUTION = """
def add(a, b):
    return a + b

def pairs(n):
    return [(i, i * i) for i in range(n)]
"""


def test_solution_against_hidden_tests(sandbox):
    tests = [
        TestCase(expr="add(2, 3)", expected=5),
        TestCase(expr="add(2, 2)", expected=5),
        TestCase(expr="pairs(2)", expected=[[0, 0], [1, 1]]),
        TestCase(expr="missing()", expected=1),
    ]
    result = run(sandbox, SOLUTION, tests=tests)
    assert result.status == "ok"
    assert [t.passed for t in result.tests] == [True, False, True, False]
    assert result.tests[1].got == 4
    assert result.tests[3].error.startswith("NameError")
    assert result.pass_fraction == 0.5


def test_stdin_stdout_and_exit_codes(sandbox):
    result = run(sandbox, "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n")
    assert (result.status, result.stdout, result.exit_code) == ("ok", "6\n", 0)
    result = run(sandbox, "raise SystemExit(3)")
    assert (result.status, result.exit_code, result.reason) == ("error", 3, "exit code 3")
    result = run(sandbox, "1 / 0")
    assert result.status == "error" and result.reason == "ZeroDivisionError: division by zero"
    assert "solution.py" in result.stderr and "pyharness" not in result.stderr


def test_tests_run_after_a_failing_solution_and_never_see_expected_values(sandbox):
    code = "def f():\n    return 1\nraise ValueError('late')"
    result = run(sandbox, code, tests=[TestCase(expr="f()", expected=1), TestCase(expr="globals().keys()", expected=0)])
    assert result.status == "error" and result.tests[0].passed
    assert "expected" not in str(result.tests[1].got)


def test_argv_programs_run_in_the_same_sandbox(sandbox):
    result = sandbox.execute_sync(ExecRequest(argv=["sh", "-c", "echo $HOME; id -u; python3 -c 'print(7)'"]))
    assert result.status == "ok"
    home, uid, seven = result.stdout.split()
    assert (home, seven) == ("/work", "7") and int(uid) >= 310_000
    result = sandbox.execute_sync(ExecRequest(argv=["no-such-binary"]))
    assert result.status == "error" and result.exit_code == 127 and "cannot execute" in result.stderr


def test_each_execution_gets_a_fresh_private_tmpfs(sandbox):
    first = run(
        sandbox, "open('/work/a', 'w').write('x'); open('/tmp/b', 'w').write('y'); import os; print(os.getcwd())"
    )
    assert (first.status, first.stdout) == ("ok", "/work\n")
    second = run(sandbox, "import os; print(sorted(os.listdir('/work')))")
    assert second.stdout == "[]\n"


def test_workspace_persists_across_executions(sandbox):
    ws = sandbox.call(sandbox._open_workspace()).result()
    try:
        first = sandbox.execute_sync(ExecRequest(argv=["sh", "-c", "echo kept > f"], workspace=ws))
        second = sandbox.execute_sync(ExecRequest(argv=["cat", "f"], workspace=ws))
        assert (first.status, second.stdout) == ("ok", "kept\n")
    finally:
        sandbox.call(sandbox._close_workspace(ws)).result()
    gone = sandbox.execute_sync(ExecRequest(argv=["true"], workspace=ws))
    assert gone.status == "sandbox_error" and "no open workspace" in gone.reason


def test_limits_are_per_request(sandbox):
    limits = SandboxLimits(wall_s=0.5, cpu_s=5)
    result = run(sandbox, "import time\ntime.sleep(5)", limits=limits)
    assert result.status == "timeout" and "0.5 s" in result.reason
    result = run(sandbox, "print('x' * 5000)", limits=SandboxLimits(output_bytes=1024))
    assert result.status == "output_limit"


def test_many_concurrent_executions(sandbox):
    def one(i: int):
        return run(sandbox, SOLUTION, tests=[TestCase(expr=f"add({i}, 1)", expected=i + 1)])

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(96)))
    assert [r.status for r in results] == ["ok"] * 96
    assert all(r.tests[0].passed for r in results)
    assert_serving(sandbox)


def test_values_match_and_judge():
    assert values_match([1, 2], (1, 2)) and values_match(0.1 + 0.2, 0.3)
    assert not values_match(True, 1) and not values_match(1, True) and not values_match("1", 1)
    assert values_match({"a": [1.0]}, {"a": [1.0000000001]}) and not values_match({"a": 1}, {"b": 1})
    cases = [TestCase(expr="x", expected=1), TestCase(expr="y", expected=2)]
    forged_then_real = [{"i": 0, "value": 9}, "junk", {"i": 0, "value": 1}]
    outcomes = judge(cases, forged_then_real)
    assert outcomes[0].passed and not outcomes[1].passed and "no result" in outcomes[1].error


def test_a_cancelled_execution_is_killed_and_its_slot_held_until_nothing_of_it_lives(sandbox):
    import asyncio

    pool = sandbox.pool

    async def cancel_one() -> None:
        slow = ExecRequest(code="import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=60))
        task = asyncio.ensure_future(pool.execute(slow))
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    start = time.monotonic()
    sandbox.call(cancel_one()).result()
    while sandbox_pids():  # its uid stays out of use while any process of it lives
        assert pool.health().running >= 1
        assert time.monotonic() - start < 20, "a cancelled execution ran on"
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while pool.health().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.health().running == 0 and time.monotonic() - start < 30  # killed, not left to its 60 s limit
    assert run(sandbox, "print(1)").stdout == "1\n"


def test_zygote_bytecode_cache_is_filled_once_and_never_under_sandbox_paths(tmp_path, monkeypatch):
    import shutil
    import sys
    import tempfile

    from prime_core.config.sandbox import SandboxPoolConfig
    from prime_orchestrator.sandbox.zygotes import bytecode_cache as _bytecode_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # /tmp is the execution's tmpfs inside the sandbox
    assert _bytecode_cache(sys.executable, []) is None
    home = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(home))
        cache = _bytecode_cache(sys.executable, ["csv"])
        assert (cache / "complete").exists() and list(cache.rglob("csv.*.pyc")) and list(cache.rglob("zygote.*.pyc"))
        assert _bytecode_cache(sys.executable, ["csv"]) == cache
    finally:
        shutil.rmtree(home)
    with pytest.raises(ValueError, match="outside /tmp"):
        SandboxPoolConfig(ro_paths=["/tmp/data"])
