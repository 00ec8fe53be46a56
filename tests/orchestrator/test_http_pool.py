"""The env server's pooled HTTP clients: httpx's API over aiohttp's pool, verifiers' engine client routed through it."""

from __future__ import annotations

import asyncio
import gc
import logging

import httpx
import pytest
from aiohttp import web
from prime_orchestrator.http_pool import engine_client, pool_engine_clients, pooled_client


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/echo", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/echo"


async def _echo(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(body.get("delay", 0))
    return web.json_response({"n": body["n"], "auth": request.headers.get("Authorization")})


def test_many_requests_in_flight_each_get_their_answer():
    async def main():
        runner, url = await _serve(_echo)
        client = pooled_client()
        try:
            headers = {"Authorization": "Bearer s"}
            replies = await asyncio.gather(
                *(client.post(url, json={"n": i, "delay": 0.05}, headers=headers) for i in range(300))
            )
        finally:
            await client.aclose()
            await runner.cleanup()
        return replies

    replies = asyncio.run(main())
    assert [r.status_code for r in replies] == [200] * 300
    assert [r.json()["n"] for r in replies] == list(range(300))
    assert {r.json()["auth"] for r in replies} == {"Bearer s"}


def test_httpx_read_timeout_is_honoured():
    async def main():
        runner, url = await _serve(_echo)
        client = pooled_client(httpx.Timeout(None, read=0.2))
        try:
            with pytest.raises(httpx.TimeoutException):
                await client.post(url, json={"n": 0, "delay": 0.6})
            return (await client.post(url, json={"n": 1})).json()["n"]
        finally:
            await client.aclose()
            await runner.cleanup()

    assert asyncio.run(main()) == 1


def test_a_client_never_closed_is_closed_with_its_loop(caplog):
    """One client per event loop lives as long as the process: nothing reports it unclosed when the loop ends."""

    async def main():
        runner, url = await _serve(_echo)
        client = pooled_client()
        assert (await client.post(url, json={"n": 0})).status_code == 200
        await runner.cleanup()
        return client

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        client = asyncio.run(main())
        session = client._transport.client
        del client
        gc.collect()
    assert session.closed
    assert "Unclosed" not in caplog.text


def test_verifiers_engine_client_uses_the_pool(monkeypatch):
    from httpx_aiohttp import AiohttpTransport
    from prime_orchestrator.http_pool import Bounded
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import TrainClientConfig

    monkeypatch.setattr(base, "build_async_httpx", base.build_async_httpx)  # restored after the test
    pool_engine_clients()
    config = TrainClientConfig(base_url="http://127.0.0.1:1/v1")
    openai_client = base.build_async_openai(config)
    http = openai_client._client
    assert isinstance(http._transport, Bounded) and isinstance(http._transport.inner, AiohttpTransport)
    assert http.timeout == httpx.Timeout(**config.timeout.model_dump())
    assert isinstance(engine_client(config)._transport.inner, AiohttpTransport)
