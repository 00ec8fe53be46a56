"""A task that names where it must run (``workdir``, ``image``) and the ``sandbox_pool`` runtime, which runs every
command in /work with the host's tools: verifiers copies both into the runtime config unvalidated, so the runtime
itself refuses what it cannot serve, in one line, before leasing anything."""

from __future__ import annotations

import asyncio
import contextlib

import pytest


def _provision(monkeypatch, data: dict):
    """The box verifiers' agent provisions for a task of ``data`` on ``sandbox_pool`` (made, never started), or the
    ``ValueError`` that refused it."""
    import verifiers.v1 as vf
    import verifiers.v1.agent as agent_module
    import verifiers.v1.runtimes as vr
    from prime_orchestrator.sandbox import verifiers_runtime  # noqa: F401  (registers sandbox_pool)
    from verifiers.v1.configs.agent import AgentConfig

    @contextlib.asynccontextmanager
    async def made_only(config, name=None, env=None):
        yield vr.make_runtime(config, name)

    monkeypatch.setattr(agent_module, "provision_runtime", made_only)
    agent = agent_module.Agent(AgentConfig(runtime={"type": "sandbox_pool"}, model="m", harness={"id": "null"}))

    async def main():
        try:
            async with agent.provision(vf.Task(vf.TaskData(prompt="x", **data))) as runtime:
                return runtime
        except ValueError as e:
            return e

    return asyncio.run(main())


@pytest.mark.parametrize("data", [{}, {"workdir": "/work"}, {"workdir": "/work/"}])
def test_a_task_placed_in_the_workspace_gets_its_box(monkeypatch, data):
    runtime = _provision(monkeypatch, data)
    assert not isinstance(runtime, ValueError), runtime
    assert runtime.info.workdir == "/work"


def test_a_task_with_another_workdir_or_an_image_is_refused_in_one_line(monkeypatch):
    """Before: a ``workdir`` of /app failed as pydantic's 4-line '1 validation error for SandboxPoolRuntimeInfo ...
    Input should be '/work''; an ``image`` was dropped without a word, and the task's commands ran without its files."""
    workdir = str(_provision(monkeypatch, {"workdir": "/app"}))
    assert "\n" not in workdir and "workdir '/app'" in workdir
    assert "/work" in workdir and "docker or prime runtime" in workdir
    image = str(_provision(monkeypatch, {"image": "python:3.12"}))
    assert "\n" not in image and "image 'python:3.12'" in image and "docker or prime runtime" in image


def test_program_limits_given_in_part_keep_the_programs_defaults_for_the_rest():
    """`program_limits = {memory_mb = 4096}` kept a command's defaults for every other field (a 10 s wall, 16
    processes): every harness program ended 10 s into its rollout. The rest are now the program's defaults."""
    from prime_orchestrator.sandbox import verifiers_runtime
    from verifiers.v1.configs.agent import AgentConfig

    config = AgentConfig(runtime={"type": "sandbox_pool", "program_limits": {"memory_mb": 4096}}).runtime
    limits = config.program_limits
    assert limits.memory_mb == 4096
    given = {k: getattr(limits, k) for k in verifiers_runtime.PROGRAM_LIMITS if k != "memory_mb"}
    assert given == {k: v for k, v in verifiers_runtime.PROGRAM_LIMITS.items() if k != "memory_mb"}
    assert verifiers_runtime.SandboxPoolRuntimeConfig().program_limits.wall_s == 900
