"""The sandbox pool as a verifiers 0.4 runtime: ``runtime = {type = "sandbox_pool"}`` in any verifiers config.

verifiers closes its runtime choice in one discriminated union (``verifiers.v1.runtimes.RuntimeConfig``) and one
class table; importing this module adds ``sandbox_pool`` to both and rebuilds the verifiers config models that
hold a runtime field, so an ``AgentConfig``, an isolated verifier or a CLI config then accept it like
``subprocess`` or ``docker``. Each runtime leases a persistent workspace (its ``/work``, also ``/tmp``) and runs
every command as one execution of the pool with that workspace: same isolation and limits as the direct API.
No network inside. A harness program (verifiers' ``bash`` agent, the ``null`` chat loop) runs too, offline, on the
local pool: ``run_program`` runs it as one execution under ``program_limits``, with the packages the pool offers
programs instead of a ``uv sync`` from PyPI (:mod:`programs`), and with the routes verifiers names in
``prepare_execution`` (its interception endpoint, MCP tool servers: ports of this host's loopback that this process or
one it started listens on) relayed in at the same address, and nothing else (:mod:`relay`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import types
import typing
from pathlib import PurePosixPath
from typing import Annotated, Literal
from urllib.parse import urlsplit

import verifiers.v1.runtimes as vr
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits
from pydantic import BaseModel, Field, field_validator
from pydantic_config import BaseConfig
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import BaseRuntimeInfo, ProgramResult, Runtime

from prime_orchestrator.sandbox import programs, relay
from prime_orchestrator.sandbox.client import SandboxClient, get_client
from prime_orchestrator.sandbox.schemas import ExecRequest

TYPE = "sandbox_pool"
WORKDIR = "/work"
logger = logging.getLogger(__name__)
# ``read`` and ``write`` meet whatever the code left in its workspace. What the code can leave at a path (a FIFO,
# a socket, a device or a symlink to one, a loop, a directory, a file or folder it chmod-ed to 000) must not turn
# the rollout into a failure: a failed rollout trains nothing, so a policy would learn to sabotage the paths the
# reward reads instead of being scored on them. Only an absent path still raises, as on every runtime.
# Isolated (-I): with plain ``-c`` the working folder comes first on sys.path, and a ``base64.py`` or ``errno.py``
# the code left there would run as the harness's own read or write (failing it, or faking what it reads or writes).
_PYTHON = ("python3", "-I", "-c")
_READ = r"""
import base64, errno, os, stat, sys
limit, path, offset, data = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), b""
try:
    # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
except OSError as e:
    if e.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.islink(path):
        sys.exit(f"{path}: {e.strerror}")
else:
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # of the file opened, so a swap after a check changes nothing
            while len(data) < limit and (chunk := os.pread(fd, min(1 << 20, limit - len(data)), offset + len(data))):
                data += chunk
    except OSError:
        data = b""
    finally:
        os.close(fd)
sys.stdout.write(base64.b64encode(data).decode())
"""
_FULL = "workspace full"  # how _WRITE says the code filled the workspace
_WRITE = r"""
import base64, errno, os, stat, sys, tempfile
# Absolute: the code may have locked its working folder itself, and "." then resolves for nobody.
path, data = os.path.abspath(sys.argv[1]), base64.b64decode(sys.stdin.buffer.read())
def usable(d):
    return os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)
def unlock(d):  # a folder of ours the code chmod-ed: its owner bits back (anyone else's stays as it is)
    st = os.lstat(d)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        os.chmod(d, st.st_mode | 0o700)
def make(d, replace_links):  # d as a folder, whatever the code left at each step of it
    here = "/"
    for part in [p for p in d.split("/") if p]:
        if not usable(here):
            unlock(here)
        there = os.path.join(here, part)
        if not os.path.isdir(there) or replace_links and os.path.islink(there):
            if os.path.lexists(there):
                os.unlink(there)
            os.mkdir(there)
        here = there
    if not usable(here):
        unlock(here)
def write():
    parent = os.path.dirname(path)
    try:
        make(parent, False)
    except OSError:
        pass
    if not usable(parent):  # a symlink of the code's on the way, to a folder nobody may write
        make(parent, True)
    if os.path.isdir(path) and not os.path.islink(path):
        # Moved aside, not deleted: a rename in its own folder works however deep or locked what is inside it.
        os.rename(path, tempfile.mkdtemp(dir=parent, prefix=".vf-moved-"))
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".vf-write-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # replaces a symlink, FIFO or locked file itself, never what it points to
    except BaseException:
        os.unlink(tmp)
        raise
try:
    write()
except OSError as e:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        sys.exit(f"workspace full: {e.strerror}")
    # One line, not a traceback: a path outside the workspace (the rest of the box is read-only) lands here.
    sys.exit(f"{e.strerror} at {e.filename or path} (only /work and /tmp are writable)")
"""


PROGRAM_LIMITS = dict(wall_s=900, cpu_s=900, memory_mb=2048, processes=256, open_files=1024, output_bytes=8 << 20)
"""A harness program's limits where ``program_limits`` does not name them: sized for a whole rollout."""


class SandboxPoolRuntimeConfig(BaseConfig):
    type: Literal["sandbox_pool"] = "sandbox_pool"
    urls: list[str] = Field(default_factory=list)
    """Sandbox nodes to run on (empty: a pool in this process)."""
    api_key_var: str | None = None
    """Environment variable holding the nodes' bearer token."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Limits of each command run in the runtime."""
    program_limits: SandboxLimits = Field(default_factory=lambda: SandboxLimits(**PROGRAM_LIMITS))
    """Limits of the harness program (``run_program``: verifiers' ``bash`` agent or chat loop, the whole rollout, the
    model's commands included, which run as its children), sized for a rollout: past ``wall_s`` it is killed and the
    rollout fails naming this field. The fields given replace those of the program's defaults (``PROGRAM_LIMITS``),
    not of a command's. ``disk_mb`` of the workspace stays ``limits.disk_mb``."""
    workdir: Literal["/work"] = WORKDIR
    """The folder commands run in: the leased workspace, always ``/work``. verifiers reads it as every container
    runtime's (its ``isolated-verifier`` places relative artifacts there). A task that names another ``workdir`` (or
    an ``image``) is refused in one line when its runtime is made."""

    @field_validator("program_limits", mode="before")
    @classmethod
    def _over_program_defaults(cls, value):
        # Given as a table, {memory_mb = 4096} kept the command defaults for the rest: a 10 s wall and 16 processes
        # ended every harness program 10 s into its rollout.
        return {**PROGRAM_LIMITS, **value} if isinstance(value, dict) else value

    def client_config(self) -> SandboxClientConfig:
        return SandboxClientConfig(urls=self.urls, api_key_var=self.api_key_var)


class SandboxPoolRuntimeInfo(SandboxPoolRuntimeConfig, BaseRuntimeInfo):
    pass


class SandboxPoolRuntime(Runtime):
    """A verifiers runtime whose commands run isolated in the sandbox pool, in a workspace kept across runs."""

    def __init__(self, config: SandboxPoolRuntimeConfig, name: str | None = None) -> None:
        super().__init__(name)
        _check_task_placement(config)
        self.config = config
        self.info = SandboxPoolRuntimeInfo(**{**config.model_dump(), "workdir": WORKDIR})  # "/work/" is /work
        self._client: SandboxClient | None = None
        self.workspace: str | None = None
        self._routes: list[int] | None = None  # host loopback ports a program may reach (prepare_execution)

    async def start(self) -> None:
        self._client = await asyncio.to_thread(get_client, self.config.client_config())
        self.workspace = await self._client.open_workspace(self.config.limits.disk_mb)
        self.info.id = self.workspace

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        return await self._exec(argv, env, None)

    async def run_program(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        """The harness program, as one execution under ``program_limits`` that reaches the routes verifiers gave
        ``prepare_execution`` (none: no network at all), with the packages the pool offers programs."""
        self._local_pool("a harness program")
        return await self._exec(argv, env, None, program=True)

    async def _exec(self, argv: list[str], env: dict[str, str], stdin: str | None, program=False) -> ProgramResult:
        if self._client is None or self.workspace is None:
            raise SandboxError(f"runtime {self.name!r} is not started")
        limits = self.config.program_limits if program else self.config.limits
        request = ExecRequest(
            argv=argv, env=self.process_env(env), stdin=stdin, limits=limits, workspace=self.workspace
        )
        result = await self._client.execute(request, (self._routes or []) if program else None)
        if result.status == "sandbox_error":
            raise SandboxError(f"{self.name}: {result.reason}")
        # A request refused before it ran (invalid text, over the pool's size limits) has no exit code: its reason
        # is all the model learns of it, as the error its tool call returns.
        ran = result.status in ("ok", "error") and result.exit_code is not None
        reason = f"harness program stopped: {result.reason} (program_limits)" if program else result.reason
        stderr = result.stderr if ran else f"{result.stderr}\n{reason}".strip()
        exit_code = result.exit_code if result.exit_code is not None else 1
        return ProgramResult(
            exit_code=exit_code if exit_code >= 0 else 128 - exit_code, stdout=result.stdout, stderr=stderr
        )

    def _local_pool(self, what: str):
        pool = self._client.pool if self._client is not None else None
        if pool is None:
            raise SandboxError(
                f"{self.name}: {what} runs on the local sandbox pool only: a sandbox node (urls) cannot relay this "
                "host's model endpoint; leave runtime.urls empty"
            )
        return pool

    async def prepare_uv_script(self, script: str | bytes, env=None, *, activate: bool = True) -> list[str]:
        """verifiers' PEP 723 script, run with the packages the pool offers programs instead of a ``uv sync`` (no
        PyPI here); a dependency they lack is refused in one line, never downloaded. ``activate`` changes nothing:
        the program's children (the model's commands) never see those packages."""
        pool = self._local_pool("a harness program")
        data = script.encode() if isinstance(script, str) else script
        python = programs.pool_python(pool.config.python)
        versions = programs.offered(tuple(pool.config.program_packages))[0] if python else {}
        if problem := programs.unmet(data.decode(errors="replace"), versions):
            raise SandboxError(
                f"{self.name}: the sandbox_pool runtime cannot run this harness program offline: {problem}"
            )
        path = f"{WORKDIR}/.vf-scripts/{hashlib.sha256(data).hexdigest()}.py"
        # Written again for every launch (each segment of an exchange launches the program anew): the model's
        # commands of the last segment may have replaced it, and the boot refuses what its name does not hash to.
        await self.write(path, data)
        # A pool on another interpreter offers no packages (they are this process's): a script needing none still
        # runs, on the pool's own interpreter.
        return programs.program_argv(python or pool.config.python, path)

    def host_url(self, url: str) -> str:
        """Unchanged: a program reaches a route at the host's own ``127.0.0.1:<port>`` (relayed, see
        ``prepare_execution``)."""
        return url

    async def prepare_execution(self, routes: list[str] | None) -> None:
        """The routes the next program may reach: each a URL on this host's loopback served by this process or one
        it started (verifiers' interception endpoint, the MCP servers it launched), relayed in at the same address;
        any other is refused in one line (:func:`relay.foreign`)."""
        if routes is None:
            self._routes = None
            return
        ports = []
        for url in routes:
            parts = urlsplit(url)
            if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
                raise SandboxError(
                    f"{self.name}: route {url!r} is not an http://127.0.0.1:<port> URL of this host, the only kind "
                    "the sandbox_pool runtime relays to a program"
                )
            if problem := await asyncio.to_thread(relay.foreign, parts.port):
                raise SandboxError(f"{self.name}: route {url!r} is not relayed to a program: {problem}")
            ports.append(parts.port)
        if ports:
            self._local_pool("a program's model endpoint")
        self._routes = ports

    async def read(self, path: str, max_bytes: int | None = None) -> bytes:
        """verifiers' ``read``, except that a file over ``max_bytes`` reads as empty instead of raising: the code
        wrote it, and the reward should score what it finds (nothing usable), not fail the rollout."""
        if max_bytes is None or max_bytes < 0:
            return await super().read(path, max_bytes)
        data = await self._read(path, max_bytes + 1)
        return b"" if len(data) > max_bytes else data

    def _transfer_cap(self) -> int:
        return self.config.limits.output_bytes // 2

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        # Read inside the box: a symlink the code planted resolves there, not on the host. Anything but a regular
        # file it can open (a FIFO, a device, a directory, a locked file, a loop) reads as empty; an absent one raises.
        # In pieces of what one command may return (half of ``limits.output_bytes``, its base64 fits): a file read
        # as its first piece let code that padded its log past it hide the tail a reward looks at ("1 failed").
        # No process outlives its command, so the file does not change between pieces.
        data, cap = b"", self._transfer_cap()
        while True:
            want = cap if max_bytes is None else min(cap, max_bytes - len(data))
            if want <= 0:
                return data
            result = await self._exec([*_PYTHON, _READ, str(want), path, str(len(data))], {}, None)
            if result.exit_code != 0:
                raise SandboxError(f"read {path!r}: {result.stderr.strip()[-500:]}")
            piece = base64.b64decode(result.stdout)
            data += piece
            if len(piece) < want:
                return data

    async def write(self, path: str, data: bytes) -> None:
        # Replaces whatever the code left at ``path`` (a symlink to /dev/full, a FIFO, a directory, a locked file
        # or folder): the harness's file lands where it asked, and the code's tricks cannot fail the rollout.
        result = await self._exec([*_PYTHON, _WRITE, path], {}, base64.b64encode(data).decode())
        if result.exit_code != 0 and result.stderr.startswith(_FULL):
            # The code filled its workspace: the file is not written, and whatever reads it next finds it absent
            # (a test that fails, a zero). Logged, as an env whose own files outgrow ``disk_mb`` lands here too.
            logger.warning("%s: write %r skipped: %s", self.name, path, result.stderr.strip()[-200:])
            return
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


def _check_task_placement(config: SandboxPoolRuntimeConfig) -> None:
    """Refuse, in one line, a task this runtime would run elsewhere than it asks. verifiers puts a task's ``workdir``
    and ``image`` into the runtime config without validating it (``resolve_runtime_config``'s ``model_copy``): a
    ``workdir`` other than /work failed as a 4-line pydantic error naming neither the task nor the way out, and an
    ``image`` was dropped, so its commands ran without the image's files and scored as if the policy had failed.
    verifiers refuses an image on its subprocess runtime the same way."""
    workdir = PurePosixPath(str(config.workdir))
    if workdir != PurePosixPath(WORKDIR):
        raise ValueError(
            f"the task's workdir {str(workdir)!r} cannot be served by the sandbox_pool runtime, whose commands all run "
            f"in {WORKDIR} (its leased workspace): place the task's files under {WORKDIR}, or use the docker or prime "
            "runtime"
        )
    image = getattr(config, "image", None)
    if image is not None:
        raise ValueError(
            f"the task requires image {image!r}, but the sandbox_pool runtime has no container (its commands see the "
            "host's /usr and python3); use the docker or prime runtime"
        )


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
    """Make ``sandbox_pool`` a verifiers runtime type (idempotent): its config in verifiers' ``RuntimeConfig`` union
    and its info in ``RuntimeInfo`` (what a trace records of the runtime a seat ran in, parsed back on the host)."""
    old = vr.RuntimeConfig
    members = typing.get_args(typing.get_args(old)[0])
    if SandboxPoolRuntimeConfig in members:
        return
    original_cls = vr._runtime_cls
    vr._runtime_cls = lambda config: SandboxPoolRuntime if config.type == TYPE else original_cls(config)
    swaps = []
    for name, ours in (("RuntimeConfig", SandboxPoolRuntimeConfig), ("RuntimeInfo", SandboxPoolRuntimeInfo)):
        members = typing.get_args(typing.get_args(getattr(vr, name))[0])
        new = Annotated[typing.Union[(*members, ours)], Field(discriminator="type")]  # noqa: UP007
        setattr(vr, name, new)
        swaps.append((members, new))
    models = list(dict.fromkeys(m for m in _all_models(BaseModel) if m.__module__.startswith("verifiers.")))
    changed = []
    for model in models:
        for field in model.model_fields.values():
            for members, new in swaps:
                swapped = _swap(field.annotation, members, new)
                if swapped is not None:
                    field.annotation = swapped
                    field.discriminator = None  # the new union carries it
                    changed.append(model)
    for model in _rebuild_order(models, list(dict.fromkeys(changed))):
        model.model_rebuild(force=True)


install()
