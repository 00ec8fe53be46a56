"""A cancelled rollout ends, and takes its episode with it. Python 3.11's ``asyncio.wait_for`` hands back the awaited
outcome instead of raising when the cancel meets its end in the same turn, so a retry loop around it went on after its
cancel: the test cancels at every turn of that window; a cancel the task accepted (``cancel()`` returned True) must
end it, cancelled."""

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


class EndlessClient:
    """An env client whose episodes run until cancelled."""

    def __init__(self):
        self.episodes: list[asyncio.Task] = []

    async def run(self, *_):
        self.episodes.append(asyncio.current_task())
        await asyncio.get_running_loop().create_future()


def test_a_cancelled_rollout_cancels_its_episode_in_the_env_server():
    """Before, the episode's request task was left running: a stale rollout kept the env server (and its model and
    tool calls) busy until its own end, and nothing awaited it."""
    from prime_orchestrator.env_server import EnvServer

    async def main():
        server = EnvServer(EnvServerSpec(name="scripted", env_config={}))
        server._died, server._client = asyncio.Event(), EndlessClient()
        rollout = asyncio.create_task(server.run(client=None, model="m", sampling=None, task_data={}))
        await asyncio.sleep(0.01)
        rollout.cancel()
        (episode,) = server._client.episodes
        done, _ = await asyncio.wait({rollout, episode}, timeout=2)
        assert episode in done and episode.cancelled(), "the cancelled rollout's episode runs on"
        assert rollout.cancelled()

    asyncio.run(main())


def test_a_take_ends_when_the_server_answers_something_else():
    """A 200 that is no version record (another server behind the URL) raised in the shared flush, and every rollout
    waiting for its versions then waited forever: it falls back to the relay's bounds (None) now."""
    from aiohttp import web
    from prime_core.config.orchestrator import ClientConfig
    from prime_orchestrator.versions import Flight, VersionRecords

    async def proxy(_: web.Request) -> web.Response:
        return web.Response(text="<html>a proxy</html>")

    async def main():
        app = web.Application()
        app.router.add_post("/rollout_versions", proxy)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        records = VersionRecords(ClientConfig(base_urls=[url]))
        try:
            takes = [asyncio.create_task(records.take(Flight(tag=t, url=url))) for t in ("a", "b")]
            done, _ = await asyncio.wait(takes, timeout=2)
            assert done == set(takes), "a rollout waits forever for its versions"
            assert [t.result() for t in takes] == [None, None]
        finally:
            await records.close()
            await runner.cleanup()

    asyncio.run(main())
