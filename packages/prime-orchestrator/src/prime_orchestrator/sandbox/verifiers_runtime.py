"""The sandbox pool as a verifiers 0.4 runtime: ``runtime = {type = "sandbox_pool"}`` in any verifiers config.

verifiers closes its runtime choice in one discriminated union (``verifiers.v1.runtimes.RuntimeConfig``) and one
class table; importing this module adds ``sandbox_pool`` to both and rebuilds the verifiers config models that
hold a runtime field, so an ``AgentConfig``, an isolated verifier or a CLI config then accept it like
``subprocess`` or ``docker``. Each runtime leases a persistent workspace (its ``/work``, also ``/tmp``) and runs
every command as one execution of the pool with that workspace: same isolation and limits as the direct API.
No network inside: it suits verification, tests and code tools, not harnesses that install packages or call a
model from inside the box.
"""

from __future__ import annotations

import base64
import types
import typing
from typing import Annotated, Literal

import verifiers.v1.runtimes as vr
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits
from pydantic import BaseModel, Field
from pydantic_config import BaseConfig
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import BaseRuntimeInfo, ProgramResult, Runtime

from prime_orchestrator.sandbox.client import SandboxClient, get_client
from prime_orchestrator.sandbox.schemas import ExecRequest

TYPE = "sandbox_pool"
_WRITE = 'mkdir -p -- "$(dirname -- "$1")" && base64 -d > "$1"'


class SandboxPoolRuntimeConfig(BaseConfig):
    type: Literal["sandbox_pool"] = "sandbox_pool"
    urls: list[str] = Field(default_factory=list)
    """Sandbox nodes to run on (empty: a pool in this process)."""
    api_key_var: str | None = None
    """Environment variable holding the nodes' bearer token."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Limits of each command run in the runtime."""

    def client_config(self) -> SandboxClientConfig:
        return SandboxClientConfig(urls=self.urls, api_key_var=self.api_key_var)


class SandboxPoolRuntimeInfo(SandboxPoolRuntimeConfig, BaseRuntimeInfo):
    pass


class SandboxPoolRuntime(Runtime):
    """A verifiers runtime whose commands run isolated in the sandbox pool, in a workspace kept across runs."""

    def __init__(self, config: SandboxPoolRuntimeConfig, name: str | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.info = SandboxPoolRuntimeInfo(**config.model_dump())
        self._client: SandboxClient | None = None
        self.workspace: str | None = None

    async def start(self) -> None:
        import asyncio

        self._client = await asyncio.to_thread(get_client, self.config.client_config())
        self.workspace = await self._client.open_workspace(self.config.limits.disk_mb)
        self.info.id = self.workspace

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        return await self._exec(argv, env, None)

    async def _exec(self, argv: list[str], env: dict[str, str], stdin: str | None) -> ProgramResult:
        if self._client is None or self.workspace is None:
            raise SandboxError(f"runtime {self.name!r} is not started")
        request = ExecRequest(
            argv=argv, env=self.process_env(env), stdin=stdin, limits=self.config.limits, workspace=self.workspace
        )
        result = await self._client.execute(request)
        if result.status == "sandbox_error":
            raise SandboxError(f"{self.name}: {result.reason}")
        stderr = result.stderr if result.status in ("ok", "error") else f"{result.stderr}\n{result.reason}".strip()
        exit_code = result.exit_code if result.exit_code is not None else 1
        return ProgramResult(
            exit_code=exit_code if exit_code >= 0 else 128 - exit_code, stdout=result.stdout, stderr=stderr
        )

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        # Read inside the box (``head | base64``): a symlink the code planted resolves there, not on the host.
        return await super()._read(path, max_bytes if max_bytes is not None else self.config.limits.output_bytes // 2)

    async def write(self, path: str, data: bytes) -> None:
        result = await self._exec(["sh", "-c", _WRITE, "sh", path], {}, base64.b64encode(data).decode())
        if result.exit_code != 0:
            raise SandboxError(f"write {path!r}: {result.stderr.strip()[-500:]}")

    async def teardown(self) -> None:
        if self._client is not None and self.workspace is not None:
            await self._client.close_workspace(self.workspace)
        self.workspace = None

    def cleanup(self) -> None:
        if self._client is not None and self.workspace is not None:
            self._client.call(self._client._close_workspace(self.workspace)).result(timeout=30)
            self.workspace = None


def _swap(annotation, members: tuple, new):
    """``annotation`` with verifiers' runtime union replaced by ``new`` (None: it holds no runtime union)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:  # the discriminator it carries comes back with ``new``
        return _swap(args[0], members, new)
    if origin in (typing.Union, types.UnionType):
        if set(args) == set(members):
            return new
        swapped = [_swap(a, members, new) for a in args]
        if any(s is not None for s in swapped):
            return typing.Union[tuple(s if s is not None else a for s, a in zip(swapped, args, strict=True))]  # noqa: UP007
    return None


def _all_models(cls: type[BaseModel]):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_models(sub)


def _referenced(annotation) -> set[type]:
    found = {annotation} if isinstance(annotation, type) else set()
    for arg in typing.get_args(annotation):
        found |= _referenced(arg)
    return found


def _rebuild_order(models: list[type[BaseModel]], changed: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """``changed`` and every model embedding one of them (directly or not), children before their parents:
    a parent's schema copies its fields' schemas at build time."""
    order, done = list(changed), set(changed)
    refs = {m: set().union(*(_referenced(f.annotation) for f in m.model_fields.values())) for m in models}
    grew = True
    while grew:
        grew = False
        for model in models:
            if model not in done and refs[model] & done:
                order.append(model)
                done.add(model)
                grew = True
    return order


def install() -> None:
    """Make ``sandbox_pool`` a verifiers runtime type (idempotent)."""
    old = vr.RuntimeConfig
    members = typing.get_args(typing.get_args(old)[0])
    if SandboxPoolRuntimeConfig in members:
        return
    new = Annotated[typing.Union[(*members, SandboxPoolRuntimeConfig)], Field(discriminator="type")]  # noqa: UP007
    original_cls = vr._runtime_cls
    vr._runtime_cls = lambda config: SandboxPoolRuntime if config.type == TYPE else original_cls(config)
    vr.RuntimeConfig = new
    models = list(dict.fromkeys(m for m in _all_models(BaseModel) if m.__module__.startswith("verifiers.")))
    changed = []
    for model in models:
        for field in model.model_fields.values():
            swapped = _swap(field.annotation, members, new)
            if swapped is not None:
                field.annotation = swapped
                field.discriminator = None  # the new union carries it
                changed.append(model)
    for model in _rebuild_order(models, list(dict.fromkeys(changed))):
        model.model_rebuild(force=True)


install()
