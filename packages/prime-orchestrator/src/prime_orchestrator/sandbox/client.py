"""The direct API: ``run(code, stdin=..., tests=..., limits=...) -> ExecResult``, on a local pool or sandbox nodes.

Every sandbox I/O runs on one daemon thread's event loop, so the same client serves sync callers, any asyncio
loop (verifiers' env workers, the orchestrator) and several at once. ``PRIME_SANDBOX_URLS`` (comma-separated
``http://host:port``) sends the default client to sandbox nodes without touching any config.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits

from prime_orchestrator.sandbox.schemas import ExecRequest, ExecResult, TestCase

T = TypeVar("T")
URLS_VAR = "PRIME_SANDBOX_URLS"


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prime-sandbox", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Stop the loop and close it: left to the garbage collector, a loop whose self-pipe was collected first
        raises from its ``__del__``."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class SandboxClient:
    """Executes requests on a local :class:`SandboxPool` (``urls`` empty) or on sandbox nodes over HTTP."""

    def __init__(self, config: SandboxClientConfig | None = None) -> None:
        self.config = config or SandboxClientConfig()
        self._thread = _LoopThread()
        self._pool = None
        self._http = None
        self._urls = itertools.cycle(self.config.urls) if self.config.urls else None
        self._ready = self._thread.submit(self._start())
        self._ready.result()

    @property
    def pool(self):
        """The local pool (None in remote mode); lives on the client's loop thread."""
        return self._pool

    async def _start(self) -> None:
        if self._urls is None:
            from prime_orchestrator.sandbox.pool import SandboxPool

            self._pool = SandboxPool(self.config.pool)
            await self._pool.start()
        else:
            import httpx

            key = os.environ.get(self.config.api_key_var) if self.config.api_key_var else None
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            self._http = httpx.AsyncClient(headers=headers, limits=httpx.Limits(max_connections=1024))

    async def _execute(self, request: ExecRequest, routes: list[int] | None = None) -> ExecResult:
        if problem := request.not_text():  # before the JSON for a node, which cannot hold it
            return ExecResult(status="error", reason=problem)
        if self._pool is not None:
            return await self._pool.execute(request, routes)
        if routes is not None:  # a node's loopback is not this host's: it would relay to the node's own services
            raise ValueError("a harness program runs on the local sandbox pool only, not on sandbox nodes (urls)")
        return await self._remote(request)

    async def _remote(self, request: ExecRequest) -> ExecResult:
        import httpx

        limits = request.limits or self.config.pool.limits
        timeout = limits.wall_s + self.config.timeout_s
        body = request.model_dump(mode="json")
        pinned = None
        if request.workspace is not None:  # a workspace lives on one node: "<url>#<name>"
            pinned, _, body["workspace"] = request.workspace.partition("#")
        error = ""
        for _ in range(self.config.max_retries + 1):
            url = pinned or next(self._urls)
            try:
                resp = await self._http.post(f"{url}/execute", json=body, timeout=timeout)
            except httpx.ConnectError as e:  # nothing ran there: another node may take it
                error = f"{url}: {e}"
                continue
            except httpx.HTTPError as e:
                return ExecResult(status="sandbox_error", reason=f"sandbox node {url}: {type(e).__name__}: {e}")
            if resp.status_code == 413:  # over the node's body limit: the request's fault, like the pool's own limits
                return ExecResult(
                    status="error", reason=f"request body over the limit of sandbox node {url} (HTTP 413)"
                )
            if resp.status_code != 200:
                return ExecResult(status="sandbox_error", reason=f"sandbox node {url}: HTTP {resp.status_code}")
            return ExecResult.model_validate(resp.json())
        return ExecResult(status="sandbox_error", reason=f"no sandbox node reachable ({error})")

    async def execute(self, request: ExecRequest, routes: list[int] | None = None) -> ExecResult:
        """Run ``request`` from any event loop (``routes``: as a harness program, see ``SandboxPool.execute``)."""
        return await asyncio.wrap_future(self._thread.submit(self._execute(request, routes)))

    def execute_sync(self, request: ExecRequest) -> ExecResult:
        """Run ``request`` from synchronous code (never from the client's own loop thread)."""
        return self._thread.submit(self._execute(request)).result()

    async def _open_workspace(self, disk_mb: int | None = None) -> str:
        if self._pool is not None:
            return await self._pool.open_workspace(disk_mb)
        url = next(self._urls)
        resp = await self._http.post(f"{url}/workspaces", json={"disk_mb": disk_mb}, timeout=self.config.timeout_s)
        resp.raise_for_status()
        return f"{url}#{resp.json()['name']}"

    async def _close_workspace(self, name: str) -> None:
        if self._pool is not None:
            await self._pool.close_workspace(name)
            return
        url, _, ws = name.partition("#")
        await self._http.delete(f"{url}/workspaces/{ws}", timeout=self.config.timeout_s)

    async def open_workspace(self, disk_mb: int | None = None) -> str:
        """A workspace (persistent /work of ``disk_mb``, default the pool's) to name in ``ExecRequest.workspace``;
        remote ones stay on their node."""
        return await asyncio.wrap_future(self._thread.submit(self._open_workspace(disk_mb)))

    async def close_workspace(self, name: str) -> None:
        await asyncio.wrap_future(self._thread.submit(self._close_workspace(name)))

    def call(self, coro: Coroutine[Any, Any, T]):
        """Schedule ``coro`` on the client's loop (where the pool lives); returns a concurrent future."""
        return self._thread.submit(coro)

    def close(self) -> None:
        async def _close() -> None:
            if self._pool is not None:
                await self._pool.close()
            if self._http is not None:
                await self._http.aclose()

        self._thread.submit(_close()).result()
        self._thread.stop()


_default: dict[str, SandboxClient] = {}
_default_lock = threading.Lock()


def _key(config: SandboxClientConfig | None) -> tuple[str, SandboxClientConfig]:
    if config is None:
        urls = [u.strip() for u in os.environ.get(URLS_VAR, "").split(",") if u.strip()]
        config = SandboxClientConfig(urls=urls)
    return json.dumps(config.model_dump(mode="json"), sort_keys=True), config


def get_client(config: SandboxClientConfig | None = None) -> SandboxClient:
    """The process-wide client for ``config`` (default: a local pool, or the nodes in ``PRIME_SANDBOX_URLS``)."""
    key, config = _key(config)
    with _default_lock:
        if key not in _default:
            _default[key] = SandboxClient(config)
        return _default[key]


def _request(code: str, stdin: str | None, tests, limits: SandboxLimits | None) -> ExecRequest:
    cases = [t if isinstance(t, TestCase) else TestCase.model_validate(t) for t in tests or []]
    return ExecRequest(code=code, stdin=stdin, tests=cases, limits=limits)


def run(
    code: str,
    *,
    stdin: str | None = None,
    tests: list[TestCase | dict] | None = None,
    limits: SandboxLimits | None = None,
    config: SandboxClientConfig | None = None,
) -> ExecResult:
    """Run Python ``code`` isolated (optionally against ``tests``) and return how it went. Never raises for
    anything the code does; ``ExecResult.status`` and ``.reason`` say what happened."""
    return get_client(config).execute_sync(_request(code, stdin, tests, limits))


async def arun(
    code: str,
    *,
    stdin: str | None = None,
    tests: list[TestCase | dict] | None = None,
    limits: SandboxLimits | None = None,
    config: SandboxClientConfig | None = None,
) -> ExecResult:
    """:func:`run` for async callers (any event loop)."""
    client = _default.get(_key(config)[0]) or await asyncio.to_thread(get_client, config)  # start-up off the loop
    return await client.execute(_request(code, stdin, tests, limits))
