"""The in-process chat harness (see the package docstring)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import traceback
import weakref
from importlib.metadata import version
from typing import Any

import httpx
from openai.types.chat import ChatCompletion
from prime_orchestrator.http_pool import pooled_client
from pydantic import Field
from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

from prime_chat import tool_output


class PrimeChatHarnessConfig(NullHarnessConfig):
    max_tool_output_bytes: int = Field(16 * 2**20, gt=0)
    """Bytes of a tool server's answer read per call; past it the call's result is the head of its text and a marker
    saying it was cut (``prime_chat.tool_output``). The model sees at most 20 kB of any result either way."""


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def interception_client() -> httpx.AsyncClient:
    """The event loop's one client for model and tool-gate calls, pooled (``prime_orchestrator.http_pool``): a client
    per turn loaded the CA bundle each time (several ms of CPU). No connection cap: the env's concurrency bounds it."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = pooled_client()
    return client


@functools.cache
def chat_program() -> dict[str, Any]:
    """verifiers' ``null`` chat program (its utils modules bundled into one script), loaded once per process as a
    namespace. Its ``__main__`` guard stays inert; we call its chat loop, MCP client and compactor directly.

    One name is ours: ``mcp_client``, which its MCP connections open, reads a tool server's answer through a capped
    transport (``prime_chat.tool_output``). Checked here, so a verifiers whose connections stop calling it fails
    loudly instead of dropping the cap."""
    namespace: dict[str, Any] = {"__name__": "prime_chat.chat_program"}
    exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers null chat program>", "exec"), namespace)  # noqa: S102
    if "mcp_client" not in namespace or "mcp_client" not in namespace["MCPConnection"].serve.__code__.co_names:
        raise RuntimeError(f"verifiers {version('verifiers')}'s chat program no longer opens MCP via mcp_client")
    namespace["mcp_client"] = tool_output.mcp_client
    return namespace


def context_overflow(status: int, text: str) -> bool:
    """Whether a model call was refused for the context window, as verifiers' chat program judges an
    ``APIStatusError`` (``is_context_overflow``: a 400 or 413 naming the limit)."""
    return status in (400, 413) and any(m in text.casefold() for m in chat_program()["CONTEXT_OVERFLOW_MARKERS"])


class Answered:
    """A chat program ``Compactor`` whose first ``complete`` is a completion already made (its loop starts with a
    model call)."""

    def __init__(self, compactor: Any, completion: Any):
        self._compactor, self._first = compactor, completion

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compactor, name)

    async def complete(self, messages: list[dict]) -> tuple[Any, list[dict]]:
        if self._first is not None:
            completion, self._first = self._first, None
            return completion, messages
        return await self._compactor.complete(messages)


def initial_messages(system_prompt: str | None, prompt: Any) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(prompt, str):  # verifiers' program sends no user message for an empty prompt string
        messages += [{"role": "user", "content": prompt}] if prompt else []
    elif prompt is not None:
        messages += [message_to_wire(m) for m in prompt]
    return messages


class PrimeChatHarness(NullHarness, Harness[PrimeChatHarnessConfig]):  # Harness[...]: verifiers reads the config type
    """``null`` run inside the env server: the same chat loop, every model call through the interception endpoint,
    so the trace records each exactly as it would the program's."""

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to provision: episodes on a local runtime launch no program."""

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
        system_prompt, prompt = self.resolve_prompt(data)
        messages = initial_messages(system_prompt, prompt)
        if not mcp_urls:
            return await self.tool_less_turn(ctx, endpoint, secret, messages, tool_interception_url)
        if runtime.type != "subprocess":  # tool servers may only be reachable from inside the runtime
            await NullHarness.setup(self, runtime)
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        return await self.tool_loop(ctx, endpoint, secret, mcp_urls, messages, tool_interception_url)

    async def tool_less_turn(
        self, ctx: ModelContext, endpoint: str, secret: str, messages: list[dict], tool_interception_url: str | None
    ) -> ProgramResult:
        """One model call, no tools: the whole episode turn (a multi-turn ``Env`` calls launch once per turn). A reply
        that calls tools anyway goes on in verifiers' chat loop, as its program does: each call is answered
        ``error: unknown tool`` and the model is asked again (the turn ended there, scored on a reply that only called
        a tool, where ``vf-eval`` lets the model answer)."""
        body = {"model": ctx.model, "messages": messages}
        try:
            resp = await interception_client().post(
                endpoint.rstrip("/") + "/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
            )
        except httpx.TransportError as e:
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", f"{type(e).__name__}: {e}")
        if resp.status_code >= 400:
            if context_overflow(resp.status_code, resp.text):
                # verifiers' chat program ends its run here, as a budget limit and not a crash: the episode is scored
                # on its turns so far. Failed instead, the turns that filled the context trained nothing.
                return ProgramResult(0, "", "")
            return ProgramResult(1, "", f"model call failed ({resp.status_code}): {resp.text[:2000]}")
        answer = resp.json()
        message = answer["choices"][0]["message"]
        if message.get("tool_calls"):
            return await self.tool_loop(ctx, endpoint, secret, {}, messages, tool_interception_url, answered=answer)
        return ProgramResult(0, json.dumps(message.get("content") or ""), "")

    async def tool_loop(
        self,
        ctx: ModelContext,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        messages: list[dict],
        tool_interception_url: str | None,
        answered: dict | None = None,
    ) -> ProgramResult:
        """verifiers' chat loop with MCP tools, as its program's ``main`` runs it, in this process: a program per
        rollout cost a Python start and its imports (about a second of CPU), which bounded tool-use rollouts by
        the host's cores rather than by the model. ``answered``: the chat completion of the conversation's first
        model call, already made (a tool-less turn that called tools)."""
        program = chat_program()
        client = program["AsyncOpenAI"](
            base_url=endpoint,
            api_key=secret,
            timeout=httpx.Timeout(None, connect=5.0),
            http_client=interception_client(),
        )
        args = argparse.Namespace(
            api_key=secret, tool_interception_url=tool_interception_url or "", bash=False, edit=False, search=False
        )
        cap = self.config.max_tool_output_bytes
        mcp_config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout, "max_output_bytes": cap}
                                     for name, url in mcp_urls.items()}}  # fmt: skip
        try:
            async with contextlib.AsyncExitStack() as stack:
                tools, dispatch, servers = [], {}, {}
                if mcp_urls:
                    connect = program["connect_mcp"](mcp_config, stack)
                    tools, dispatch, servers = await asyncio.wait_for(connect, 60)
                compactor = program["Compactor"](client, ctx.model, tools, False, None)
                if answered is not None:
                    compactor = Answered(compactor, ChatCompletion.model_validate(answered))
                compactor.note_good(messages)
                gate = interception_client() if tool_interception_url else None
                await program["run_chat_loop"](args, compactor, messages, dispatch, servers, gate)
        except SystemExit as e:  # the program's exit on a model transport error
            return ProgramResult(int(e.code or 0), "", traceback.format_exc())
        except Exception:
            return ProgramResult(1, "", traceback.format_exc())
        return ProgramResult(0, "", "")
