"""The in-process chat harness (see the package docstring)."""

from __future__ import annotations

import json

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
            async with httpx.AsyncClient(timeout=None) as client:
                resp = await client.post(
                    endpoint.rstrip("/") + "/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {secret}"},
                )
        except httpx.TransportError as e:
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", f"{type(e).__name__}: {e}")
        if resp.status_code >= 400:
            return ProgramResult(1, "", f"model call failed ({resp.status_code}): {resp.text[:2000]}")
        message = resp.json()["choices"][0]["message"]
        return ProgramResult(0, json.dumps(message.get("content") or ""), "")
