"""What the code leaves in a ``sandbox_pool`` workspace cannot turn its rollout into a failed one.

A failed rollout trains nothing (docs/orchestrator.md, "Faults"), so a policy that cannot solve a task could dodge
the zero of a wrong answer by sabotaging the path the reward reads or the harness writes: a FIFO there, a symlink
to /dev/full, a directory, a file or folder locked with chmod 000, an over-size file, a full workspace. Here the
"agent" plants each one with a command, as its bash tool would; then the reward reads its answer, and the harness
writes its own file (a test file, say) and reads it back. The reward scores 0, the harness's file lands, and
nothing raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
from verifiers.v1.errors import SandboxError

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(300)]

# wall_s bounds each command: on the old runtime a read of a FIFO waited for it and then raised SandboxError.
LIMITS = {"wall_s": 5, "cpu_s": 5}

PLANTED = {
    "fifo": "mkfifo answer.txt",
    "socket": "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('answer.txt')\"",
    "symlink_to_dev_full": "ln -s /dev/full answer.txt",
    "symlink_to_dev_zero": "ln -s /dev/zero answer.txt",
    "symlink_to_proc": "ln -s /proc/self/fd/0 answer.txt",
    "symlink_loop": "ln -s answer.txt answer.txt",
    "directory": "mkdir -p answer.txt/deep && echo 42 > answer.txt/deep/f && chmod 000 answer.txt/deep",
    "file_chmod_000": "echo 41 > answer.txt && chmod 000 answer.txt",
    "workspace_root_chmod_000": "echo 41 > answer.txt && chmod 000 .",
    "over_size_file": "head -c 5000000 /dev/zero > answer.txt",
}

# Where the harness writes its own files: a folder the code replaced with a file, a symlink to a read-only
# folder, a folder locked with chmod 000.
BLOCKED_DIRS = {
    "file_for_folder": "echo x > tests",
    "symlink_to_read_only": "ln -s /etc tests",
    "folder_chmod_000": "mkdir -p tests/unit && chmod 000 tests/unit tests",
}


def _runtime_config() -> dict:
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root (user namespaces with a uid range)")
    return {"type": "sandbox_pool", "limits": LIMITS}


async def _in_workspace(planted: str, then):
    import verifiers.v1.runtimes as vr
    from prime_orchestrator.sandbox import verifiers_runtime  # noqa: F401  (registers sandbox_pool)
    from verifiers.v1.configs.agent import AgentConfig

    agent = AgentConfig(runtime=_runtime_config())
    async with vr.provision_runtime(agent.runtime) as runtime:
        await runtime.run(["sh", "-c", planted], {})  # the agent's command
        return await then(runtime)


async def _score_then_harness(runtime) -> tuple[float, bytes, bytes]:
    answer = await runtime.read("answer.txt", max_bytes=1000)  # the reward: 1.0 for "42"
    score = 1.0 if answer.strip() == b"42" else 0.0
    await runtime.write("answer.txt", b"harness\n")  # the harness overwrites it with a file of its own
    back = await runtime.read("answer.txt")
    return score, answer, back


@pytest.mark.parametrize("attack", sorted(PLANTED))
def test_what_the_code_plants_at_a_path_reads_as_nothing_and_is_overwritten(attack):
    score, answer, back = asyncio.run(_in_workspace(PLANTED[attack], _score_then_harness))
    assert (score, answer, back) == (0.0, b"", b"harness\n")


@pytest.mark.parametrize("attack", sorted(BLOCKED_DIRS))
def test_the_harness_writes_its_file_through_whatever_the_code_left_on_the_way(attack):
    async def harness(runtime):
        await runtime.write("tests/unit/test_x.py", b"assert True\n")
        ran = await runtime.run(["python3", "tests/unit/test_x.py"], {})
        return await runtime.read("tests/unit/test_x.py"), ran.exit_code

    assert asyncio.run(_in_workspace(BLOCKED_DIRS[attack], harness)) == (b"assert True\n", 0)


def test_a_full_workspace_skips_the_write_and_the_reward_finds_nothing():
    async def harness(runtime):
        await runtime.write("tests/test_x.py", b"assert True\n" * 1000)  # no room: skipped, not raised
        ran = await runtime.run(["python3", "tests/test_x.py"], {})
        score = 1.0 if ran.exit_code == 0 else 0.0
        with pytest.raises(SandboxError, match="No such file"):  # absent, as the code had left it
            await runtime.read("tests/test_x.py")
        return score

    # Filled until the quota refuses, then topped up byte by byte in a second file: no room for even a page.
    fill = "cat /dev/zero > fill; python3 -c \"f = open('top', 'wb', 0)\nwhile f.write(b'x'): pass\"; true"
    assert asyncio.run(_in_workspace(fill, harness)) == 0.0


def test_an_absent_file_still_raises_and_a_plain_one_reads_back():
    """The contract every verifiers runtime keeps: only a path that is not there at all raises on read."""

    async def check(runtime):
        with pytest.raises(SandboxError, match="No such file"):
            await runtime.read("missing.txt")
        assert await runtime.read("plain.txt", max_bytes=3) == b"42\n"
        assert await runtime.read("plain.txt", max_bytes=2) == b""  # over the cap: nothing usable
        assert await runtime.read("/tmp/t.bin") == bytes(range(256))

    asyncio.run(
        _in_workspace("echo 42 > plain.txt; python3 -c \"open('/tmp/t.bin','wb').write(bytes(range(256)))\"", check)
    )


def test_modules_the_code_plants_in_its_folder_never_run_as_the_harnesss_read_or_write():
    """``read`` and ``write`` run Python in the workspace: a ``base64.py`` there must not stand in for the stdlib's,
    or the code would choose what the reward reads (``42``) and what test file the harness writes."""
    fake = "b64encode = lambda b: __import__('binascii').b2a_base64(b'42', newline=False)\\nb64decode = b64encode\\n"
    plant = f"printf \"{fake}\" > base64.py; echo 'raise SystemExit(4)' > errno.py; echo 41 > answer.txt"

    async def check(runtime):
        answer = await runtime.read("answer.txt")
        await runtime.write("test_x.py", b"assert False\n")
        ran = await runtime.run(["sh", "-c", "cd /tmp && python3 /work/test_x.py"], {})
        return answer, await runtime.read("test_x.py"), ran.exit_code

    assert asyncio.run(_in_workspace(plant, check)) == (b"41\n", b"assert False\n", 1)


SURROGATE_CODE = "# \udcff\ndef f(x):\n    return x\n"  # "\\udcff" in a tool call's JSON arguments parses to this


def test_a_lone_surrogate_in_a_command_is_an_error_the_tool_call_returns():
    async def check(runtime):
        return [await runtime.run(argv, env) for argv, env in ((["echo", "a\udcffb"], {}), (["true"], {"X": "\ud800"}))]

    results = asyncio.run(_in_workspace("true", check))
    assert [(r.exit_code, "not valid text" in r.stderr) for r in results] == [(1, True), (1, True)], results


def test_a_lone_surrogate_in_graded_code_scores_zero_in_a_local_pool():
    from prime_core.config.sandbox import SandboxLimits
    from prime_orchestrator.sandbox import TestCase, arun

    _runtime_config()  # skips where no pool runs
    tests = [TestCase(expr="f(2)", expected=2)]
    result = asyncio.run(arun(SURROGATE_CODE, tests=tests, limits=SandboxLimits(**LIMITS)))
    assert (result.status, result.pass_fraction, "not valid text" in result.reason) == ("error", 0.0, True), result


def test_a_lone_surrogate_scores_zero_through_a_node_and_the_node_serves_on(node, monkeypatch):
    from prime_core.config.sandbox import SandboxClientConfig
    from prime_orchestrator.sandbox import ExecRequest, SandboxClient, TestCase

    monkeypatch.setenv("NODE_KEY", node.key)
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    try:
        sent = client.execute_sync(ExecRequest(code=SURROGATE_CODE, tests=[TestCase(expr="f(2)", expected=2)]))
        after = client.execute_sync(ExecRequest(code="print(6 * 7)"))
    finally:
        client.close()
    assert (sent.status, sent.pass_fraction) == ("error", 0.0), sent
    assert (after.status, after.stdout) == ("ok", "42\n"), after


def test_a_command_over_the_pools_size_limit_returns_its_reason_to_the_model():
    """Refused before it ran, it has no exit code of its own: the reason is the only error the tool call can return
    (before: exit 1 with an empty stderr)."""

    async def check(runtime):
        return await runtime.run(["echo", "x" * 2_000_000], {})

    result = asyncio.run(_in_workspace("true", check))
    assert (result.exit_code, "max_code_bytes" in result.stderr) == (1, True), result.stderr[:300]


def test_a_file_bigger_than_one_commands_output_reads_whole_within_max_bytes():
    """Before: ``read(path, max_bytes=10 MB)`` of a 5 MB (here 2 MB) file the code wrote hit the command's output limit, and
    raised SandboxError; then it read as nothing. Now it reads whole, in pieces of half ``output_bytes``."""

    async def check(runtime):
        return (
            await runtime.read("big", max_bytes=10_000_000),
            await runtime.read("small", max_bytes=10_000_000),
            await runtime.read("big", max_bytes=1_999_999),  # over max_bytes: nothing usable, not a failed rollout
            (await runtime.run(["sha256sum", "big"], {})).stdout.split()[0],
        )

    plant = "head -c 2000000 /dev/urandom > big; echo 42 > small"
    big, small, over, digest = asyncio.run(_in_workspace(plant, check))
    assert (len(big), hashlib.sha256(big).hexdigest(), small, over) == (2_000_000, digest, b"42\n", b"")


def test_a_log_padded_past_one_commands_output_reads_whole():
    """Before: ``read(path)`` returned the first half of ``output_bytes`` (512 KiB) of a file and dropped the rest,
    so code that printed 600 kB before its tests failed hid '1 failed' from a reward reading the log."""

    async def check(runtime):
        return await runtime.read("log.txt")

    plant = "head -c 600000 /dev/zero | tr '\\0' ' ' > log.txt; echo '1 failed' >> log.txt"
    log = asyncio.run(_in_workspace(plant, check))
    assert len(log) == 600_009 and log.endswith(b"1 failed\n")


def test_a_nul_byte_in_a_command_is_an_error_the_tool_call_names():
    """Before: exit code 71 and an empty stderr, so the model learned nothing of why its command did not run."""

    async def check(runtime):
        return [await runtime.run(argv, env) for argv, env in ((["echo", "a\x00b"], {}), (["true"], {"X": "\x00"}))]

    results = asyncio.run(_in_workspace("true", check))
    assert [(r.exit_code, "NUL byte" in r.stderr) for r in results] == [(1, True), (1, True)], results


def test_a_write_outside_the_workspace_fails_in_one_line():
    """Before: SandboxError("write '/etc/evil': " + the last 500 characters of the write program's traceback)."""

    async def harness(runtime):
        with pytest.raises(SandboxError) as outside:
            await runtime.write("/etc/evil", b"x")
        return str(outside.value)

    error = asyncio.run(_in_workspace("true", harness))
    assert "\n" not in error and "Traceback" not in error and "File " not in error
    assert error.startswith("write '/etc/evil': ") and "Read-only file system" in error
