"""A cancelled rollout ends: Python 3.11's ``asyncio.wait_for`` hands back the awaited outcome instead of raising when
the cancel meets its end in the same turn, so a retry loop around it went on after its cancel. Each test cancels at
every turn of that window; a cancel the task accepted (``cancel()`` returned True) must end it, cancelled."""

from __future__ import annotations

import asyncio

from prime_core.config.orchestrator import EnvConfig
from prime_core.schemas.rollout import EnvServerSpec
from prime_orchestrator.env_server import EnvServerCrashed
from prime_orchestrator.envs import EnvRunner


class CrashingServer:
    """An env server whose every run dies when the test opens its gate."""

    def __init__(self):
        self.runs = 0
        self.gate: asyncio.Future | None = None

    async def run(self, **_):
        self.runs += 1
        self.gate = asyncio.get_running_loop().create_future()
        await self.gate
        raise EnvServerCrashed("env server scripted died during a rollout")


class Tasks:
    def task_data(self, example: int) -> dict:
        return {"example": example}


def test_a_rollout_cancelled_as_its_server_crashes_is_not_retried():
    async def main():
        env = EnvConfig(id="vf-rubric", rollout_timeout=60)
        for turns in range(4):
            runner = EnvRunner(env, EnvServerSpec(name="scripted", env_config={}), max_retries=2)
            runner.server, runner.tasks = CrashingServer(), Tasks()
            rollout = asyncio.create_task(runner.rollout(0, client=None, model="m", sampling={}))
            await asyncio.sleep(0.01)
            runner.server.gate.set_result(None)
            for _ in range(turns):
                await asyncio.sleep(0)
            if not rollout.cancel():
                continue
            runs = runner.server.runs
            done, _ = await asyncio.wait({rollout}, timeout=2)
            assert done == {rollout}, f"the cancel {turns} turn(s) after the crash was swallowed: the rollout ran on"
            assert rollout.cancelled() and runner.server.runs == runs  # no attempt after the cancel
            if runner.server.gate is not None and not runner.server.gate.done():
                runner.server.gate.cancel()

    asyncio.run(main())
