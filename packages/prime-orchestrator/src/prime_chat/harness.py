"""The in-process chat harness (see the package docstring)."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import json
import sys
import weakref

import httpx
from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace


class PrimeChatHarnessConfig(NullHarnessConfig):
    pass


# What verifiers' chat program imports beyond the stdlib (its PEP 723 header; all are verifiers' own dependencies).
PROGRAM_DEPENDENCIES = ("openai", "mcp", "httpx", "tenacity", "certifi", "anyio")


@functools.cache
def interpreter_runs_program() -> bool:
    """Whether this interpreter can run verifiers' chat program as it is (no uv environment needed)."""
    return all(importlib.util.find_spec(name) is not None for name in PROGRAM_DEPENDENCIES)


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def interception_client() -> httpx.AsyncClient:
    """The event loop's one client for model calls: building a client loads the CA bundle (several ms of CPU), which
    was half of an env worker's CPU when each turn built its own. No pool limit: the env's concurrency bounds it."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        client = _clients[loop] = httpx.AsyncClient(timeout=None, limits=limits)
    return client


class InterpreterRuntime:
    """A local rollout runtime whose uv scripts run with this interpreter: the script is written to the runtime's
    working directory and started as ``python script.py``. Everything else is the wrapped runtime's."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True):
        data = script.encode() if isinstance(script, str) else script
        path = f".prime-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


class PrimeChatHarness(NullHarness):
    """``null`` with the tool-less loop in-process; every model call still goes through the interception endpoint,
    so the trace records it exactly as it would the program's."""

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to provision until an episode needs the program (it has tool servers)."""

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        if mcp_urls:
            if runtime.type == "subprocess" and runtime.user is None and interpreter_runs_program():
                runtime = InterpreterRuntime(runtime)
            else:
                await NullHarness.setup(self, runtime)
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        body = {"model": ctx.model, "messages": messages}
        try:
            resp = await interception_client().post(
                endpoint.rstrip("/") + "/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
            )
        except httpx.TransportError as e:
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", f"{type(e).__name__}: {e}")
        if resp.status_code >= 400:
            return ProgramResult(1, "", f"model call failed ({resp.status_code}): {resp.text[:2000]}")
        message = resp.json()["choices"][0]["message"]
        return ProgramResult(0, json.dumps(message.get("content") or ""), "")
