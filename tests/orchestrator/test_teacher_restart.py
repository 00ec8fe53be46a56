"""A distillation teacher whose server goes away for a while (a restart): its scoring request ended the run after
the retries (``distill.teacher.max_retries``, ~3.5 s by default). Now a teacher that stops answering gets as long to
answer ``/health`` again as it had to start (``distill.teacher.health_timeout``, named in the log line with what is
waited for), and the request is asked once more; one that never comes back still ends the run in one line."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from prime_core.config.distill import DistillConfig, TeacherConfig
from prime_orchestrator.distill import Teacher, TeacherError

from tests.orchestrator.test_hostile_teacher import TOKENS, scores


class RestartingTeacher:
    """A teacher server on a fixed port of 127.0.0.1 that can be stopped and started again (its restart)."""

    def __init__(self):
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.scored = 0

    async def start(self) -> str:
        async def generate(request: web.Request) -> web.Response:
            await request.json()
            self.scored += 1
            return web.json_response(scores(-0.5, -1.0, -2.0))

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


def teacher_at(url: str, health_timeout: float = 60.0) -> Teacher:
    config = TeacherConfig(base_url=url, model="teacher", timeout=5, max_retries=0, health_timeout=health_timeout)
    return Teacher("math", DistillConfig(teacher=config))


async def score_once(teacher: Teacher) -> None:
    """One scoring request of ``teacher``, its client closed after."""
    try:
        await teacher.logprobs(TOKENS)
    finally:
        await teacher.client.aclose()


def teacher_error(main) -> str:
    """The ``TeacherError`` that running ``main()`` ends with, checked to be one line."""
    with pytest.raises(TeacherError) as e:
        asyncio.run(main())
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_teacher_restarted_during_scoring_is_waited_for_and_scoring_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="prime.orchestrator.distill")

    async def main() -> tuple[list[list[float]], int]:
        server = RestartingTeacher()
        url = await server.start()
        await server.stop()  # gone: the requests below find nothing on the port
        teacher = teacher_at(url)
        try:
            requests = [asyncio.create_task(teacher.logprobs(TOKENS)) for _ in range(3)]
            while teacher._outage is None:  # every request has found it gone and waits for its /health
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # a few refused /health probes of the wait
            await server.start()  # the restart
            out = await asyncio.gather(*requests)
            await server.stop()
            return out, server.scored
        finally:
            await teacher.client.aclose()

    out, scored = asyncio.run(main())
    assert out == [[0.0, -0.5, -1.0, -2.0]] * 3 and scored == 3
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1, waits  # one wait, shared by the three requests
    assert "waiting up to 60s (distill.teacher.health_timeout) for its /health to answer again" in waits[0]
    assert any("answers /health again after" in r.getMessage() for r in caplog.records)


def test_a_teacher_that_never_comes_back_ends_the_run_in_one_line():
    async def main() -> None:
        server = RestartingTeacher()
        url = await server.start()
        await server.stop()
        await score_once(teacher_at(url, health_timeout=1))

    line = teacher_error(main)
    assert line.startswith("teacher of env 'math' at http://127.0.0.1:")
    assert "does not answer (POST " in line and "ConnectError" in line
    assert line.endswith("and its /health did not answer again within 1s (distill.teacher.health_timeout)")


def test_a_slow_teacher_is_not_waited_for_as_a_restart():
    """A timeout is a teacher that answers slowly, not one that is gone: it ends at the teacher's timeout as before
    (its /health is not asked, and the run does not wait another health_timeout)."""

    async def main() -> None:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.json_response({})

        from tests.fixtures.fake_http import serving

        app = web.Application()
        app.router.add_post("/inference/v1/generate", slow)
        async with serving(app) as url:
            config = TeacherConfig(base_url=url, model="t", timeout=0.5, max_retries=0, health_timeout=600)
            teacher = Teacher("math", DistillConfig(teacher=config))
            try:
                await score_once(teacher)
            finally:
                assert teacher._outage is None

    with pytest.raises(TeacherError, match=r"failed after 1 attempts: no complete answer after 0.5s$"):
        asyncio.run(main())


def test_a_teacher_whose_health_answers_but_scoring_fails_is_one_line():
    """Its /health answers at once, its scoring keeps failing with a 503: asked once more, then one line (a
    `TeacherError`, never the client's own error as a traceback)."""

    async def main() -> None:
        from tests.fixtures.fake_http import serving

        async def busy(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "engine overloaded"}}, status=503)

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_post("/inference/v1/generate", busy)
        app.router.add_get("/health", health)
        async with serving(app) as url:
            await score_once(teacher_at(url))

    assert teacher_error(main).endswith("503: engine overloaded (after its /health answered again)")
