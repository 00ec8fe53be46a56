"""A model's command past one of its harness program's limits (``program_limits``, which the program's children
share): the command is killed and the program goes on, so the episode ends and is scored. Killing the program
failed the rollout, which trains nothing: a policy that cannot solve a task would learn to blow a limit to escape
its negative advantage. verifiers' real ``bash`` agent against a scripted model (see test_agent_programs.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.sandbox.test_agent_programs import Host, _bash_agent, _provisioned, _require_root

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(300)]

HOG = "python3 -c \"import time; b = b'x' * (300 << 20); time.sleep(3)\""


def _episode(*commands: str, **program_limits):
    """verifiers' bash agent running ``commands`` under the default program_limits, ``program_limits`` changed (a
    table naming some fields keeps the program's defaults for the rest)."""

    async def main():
        host = Host(*commands)
        async with host, _provisioned(program_limits=program_limits) as runtime:
            result = await _bash_agent(host, runtime)
            after = await runtime.run(["echo", "served"], {})  # the workspace and the pool go on
            return host, result, after

    return asyncio.run(main())


def test_a_command_past_the_memory_limit_is_killed_and_the_program_goes_on():
    """Two processes of 300 MB under a 512 MB program (576 MB with the workspace): before, the execution's OOM ended
    the program (exit 137, ``memory limit of 512 MB exceeded (program_limits)``), a failed rollout. Now the largest
    command is killed, bash reports it to the model, the next command runs and the program exits 0."""
    _require_root()
    host, result, after = _episode(f"{HOG} & {HOG}; wait; echo rc=$?", "echo next-ok", memory_mb=512)
    assert result.exit_code == 0, result.stderr[-2000:]
    killed, following = host.tool_outputs
    assert "Killed" in killed and killed.startswith("rc="), killed
    assert following == "next-ok\n"
    assert after.stdout == "served\n"


def test_a_command_spending_the_cpu_budget_is_killed_and_the_program_goes_on():
    """Two spinning processes against a program's 12 s CPU budget: before, the program was killed with them (exit 137,
    ``CPU time limit of 12.0 s exceeded (all its processes) (program_limits)``) after a few seconds of wall time, long
    before the env's ``rollout_timeout``. Now the commands are killed, the model receives their result and replies,
    and the program finishes on its reserve."""
    _require_root()
    spin = "timeout 60 sh -c 'yes > /dev/null & yes > /dev/null & wait'; echo rc=$?"
    host, result, after = _episode(spin, "echo next", cpu_s=12)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert len(host.tool_outputs) == 2, host.tool_outputs  # the killed command's result, then the next one's
    assert after.stdout == "served\n"


def test_a_program_spending_its_cpu_budget_itself_is_still_stopped():
    """The program spins itself beside a sleeping child: the child is killed first (a command), then the program,
    past its reserve, ends naming program_limits."""
    _require_root()

    async def main():
        async with _provisioned(program_limits={"cpu_s": 1, "wall_s": 30}) as runtime:
            await runtime.prepare_execution([])
            return await runtime.run_program(["sh", "-c", "sleep 100 & while :; do :; done"], {})

    result = asyncio.run(main())
    assert result.exit_code != 0
    assert result.stderr.splitlines()[-1] == (
        "harness program stopped: CPU time limit of 1.0 s exceeded (all its processes) (program_limits)"
    )


def test_commands_past_the_process_open_file_and_output_limits_fail_alone():
    """Held before this change too (the rows of docs/sandboxes.md's table): a fork past ``processes``, an open past
    ``open_files`` fail in the command (RLIMIT_NPROC and the pids cgroup, RLIMIT_NOFILE of each process), and 20 MB
    of output goes to the program's pipes, not to its stdout (verifiers cuts it for the model)."""
    _require_root()
    host, result, _ = _episode(
        "for i in $(seq 300); do sleep 3 & done; wait",
        "python3 -c \"fs = [open('/dev/null') for _ in range(2000)]\" 2>&1 | tail -n 1",
        "head -c 20000000 /dev/zero | tr '\\0' x",
        "echo next-ok",
    )
    assert result.exit_code == 0, result.stderr[-2000:]
    forks, files, flood, following = host.tool_outputs
    assert "Resource temporarily unavailable" in forks, forks
    assert "Too many open files" in files, files
    assert flood.startswith("Warning: truncated output") and len(flood) < 100_000, flood[:200]
    assert following == "next-ok\n"
