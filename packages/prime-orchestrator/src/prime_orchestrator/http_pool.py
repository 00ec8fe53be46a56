"""The env server's HTTP clients: httpx's API (which the OpenAI SDK and verifiers speak) over aiohttp's connection pool.

An env worker holds one connection per rollout in flight to the interception server and one to the inference
server, hundreds of each. httpx's own pool scans all of its connections on every request and every release (each a
``getpeername`` and a readability poll), so its CPU per request grows with the requests in flight: 3-15 ms with
64-512 in flight on a 2-core VM, where httpx over aiohttp's pool (``httpx-aiohttp``, the transport behind the OpenAI
SDK's aiohttp option) takes 0.7-0.8 ms (``benchmarks/http_pool.py``, docs/benchmarks.md). verifiers' engine client
also keeps only 100 idle connections, so past 100 rollouts in flight each turn opened a new one.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import TYPE_CHECKING

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

if TYPE_CHECKING:
    from verifiers.v1.configs.client import BaseClientConfig


def pooled_client(timeout: httpx.Timeout | None = None, max_connections: int | None = None) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose connections live in one aiohttp pool (``max_connections`` None: unbounded;
    every idle connection is kept until aiohttp's keep-alive expiry). The CA bundle is httpx's; proxy variables are
    honoured as httpx does when any is set (aiohttp's ``trust_env`` looks them up in a thread on every request, so
    it stays off without them)."""

    def session() -> aiohttp.ClientSession:  # built on the first request, inside the event loop that uses it
        connector = aiohttp.TCPConnector(limit=max_connections or 0, ssl=httpx.create_ssl_context())
        session = aiohttp.ClientSession(connector=connector, trust_env=bool(urllib.request.getproxies()))
        _keepers.add(asyncio.get_running_loop().create_task(_close_with_loop(session)))
        return session

    return httpx.AsyncClient(timeout=timeout, transport=AiohttpTransport(client=session))


_keepers: set[asyncio.Task] = set()


async def _close_with_loop(session: aiohttp.ClientSession) -> None:
    """Close ``session`` when its event loop shuts down (``asyncio.run`` cancels this task), unless its owner did:
    a client held for the life of the process (one per event loop) has no owner to close it, and aiohttp reports
    every session that is collected open."""
    try:
        while not session.closed:
            await asyncio.sleep(5)
    finally:
        await session.close()
        _keepers.discard(asyncio.current_task())


def engine_client(config: BaseClientConfig) -> httpx.AsyncClient:
    """verifiers' ``build_async_httpx`` with the pooled transport: the same timeout and connection cap."""
    from verifiers.v1.clients.base import DEFAULT_LIMITS

    return pooled_client(httpx.Timeout(**config.timeout.model_dump()), DEFAULT_LIMITS.max_connections)


def pool_engine_clients() -> None:
    """Route verifiers' OpenAI clients (the train client's engine calls, judges) through ``engine_client``.
    verifiers builds them in one function and offers no hook for the transport; this process is ours."""
    from verifiers.v1.clients import base

    base.build_async_httpx = engine_client
