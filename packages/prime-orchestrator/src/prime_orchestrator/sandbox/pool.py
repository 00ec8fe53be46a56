"""The local sandbox pool: warm zygotes (see :mod:`zygote`) and the asyncio side that feeds them.

An execution costs one JSON message and two file descriptors to a zygote (the result pipe, an optional stdin
memfd), a fork there, and one JSON verdict back; no interpreter starts. Each running execution holds a uid
of its own (so RLIMIT_NPROC counts it alone and it cannot signal a neighbour). A zygote that dies is replaced
on the next request; the executions it was running end as ``sandbox_error``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig, sandbox_owned

from prime_orchestrator.sandbox.schemas import ExecRequest, ExecResult, judge

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import zygote; zygote.main(int(sys.argv[2]), sys.argv[3])"
NUM_LEASES = 1024  # uids above the execution range, one per live workspace (verifiers runtimes)
UIDS_PER_PROCESS = 8192  # max_concurrency + NUM_LEASES fit in it
# A verdict later than its wall limit plus this is lost (the supervisor enforces the wall limit itself; a dead one
# closes the result pipe at once). Generous: on an overloaded node, requests also wait for the zygote to fork them.
RESULT_SLACK_S = 120.0
QUARANTINE_SLACK_S = 10.0  # a cancelled execution keeps its uid and slot for its wall limit plus this


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no user namespaces, not root, ...); the message says why."""


@dataclass
class Workspace:
    """A persistent working directory (host ``path``) mounted on /work for executions that name it."""

    name: str
    path: Path
    uid: int


def _sandbox_path(python: str) -> str:
    bindir = str(Path(python).resolve().parent)
    return ":".join(dict.fromkeys([bindir, "/usr/local/bin", "/usr/bin", "/bin"]))


def _bytecode_cache(python: str, preload: list[str]) -> Path | None:
    """A host directory of compiled bytecode for the zygote's interpreter (``-X pycache_prefix``), filled once per
    interpreter and module list and bound read-only into the sandbox. The sandbox's root is read-only, so with an
    interpreter whose stdlib ships without .pyc files (slim images, some distributions) every zygote start would
    compile each pre-imported module again: about 100 ms of a cold start. None when it cannot be written."""
    from prime_orchestrator.sandbox.zygote import PRELOAD

    modules = PRELOAD + preload
    key = json.dumps([str(Path(python).resolve()), modules, str(_HERE)]).encode()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prime" / "sandbox-pyc"
    root = cache / hashlib.sha256(key).hexdigest()[:16]
    if sandbox_owned(str(root)):  # e.g. XDG_CACHE_HOME under /tmp, which is the execution's tmpfs inside
        return None
    if (root / "complete").exists():
        return root
    code = (
        f"import sys; sys.path.insert(0, {str(_HERE)!r}); import zygote\n"
        f"for m in {modules!r}:\n    try: __import__(m)\n    except Exception: pass"
    )
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = [python, "-I", "-S", "-X", f"pycache_prefix={root}", "-c", code]
        subprocess.run(argv, check=True, timeout=120, capture_output=True)
        (root / "complete").touch()
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("no bytecode cache for the sandbox zygote (%s); each zygote start compiles its imports", e)
        return None
    return root


class _Zygote:
    """One zygote process and its control socket (SOCK_SEQPACKET: one message per request, never split)."""

    def __init__(self, config: SandboxPoolConfig, uid_base: int, workspaces: Path, num_uids: int) -> None:
        python = config.python or sys.executable
        prefix = str(Path(python).resolve().parent.parent)
        bytecode = _bytecode_cache(python, config.preload)
        setup = {
            "root": str(workspaces.parent / "root"),
            "ro_paths": [prefix, *config.ro_paths, *([str(bytecode)] if bytecode else [])],
            "workspaces": str(workspaces),
            "preload": config.preload,
        }
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        flags = ["-X", f"pycache_prefix={bytecode}"] if bytecode else []
        argv = [python, "-I", "-S", *flags, "-c", _BOOT, str(_HERE), str(child.fileno()), json.dumps(setup)]
        self.proc = subprocess.Popen(argv, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()
        self.sock = parent
        try:
            self._handshake(config, uid_base, num_uids)
        except BaseException:
            self.kill()
            raise
        self.sock.setblocking(False)
        self.dead = False

    def _handshake(self, config: SandboxPoolConfig, base: int, num_uids: int) -> None:
        self.sock.settimeout(config.start_timeout_s)
        first = self.sock.recv(4096)
        if first != b"unshared":
            raise SandboxUnavailable(f"sandbox zygote failed: {first.decode(errors='replace') or 'exited'}")
        try:
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{self.proc.pid}/{name}").write_text(f"0 0 1\n{base} {base} {num_uids}\n")
        except OSError as e:
            raise SandboxUnavailable(
                f"cannot map sandbox uids ({e.strerror}): the pool must run as root (CAP_SETUID) with user "
                "namespaces enabled"
            ) from None
        self.sock.send(b"mapped")
        reply = self.sock.recv(4096)
        if reply != b"ready":
            raise SandboxUnavailable(f"sandbox zygote failed: {reply.decode(errors='replace') or 'exited'}")

    async def send(self, msg: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            try:
                self.sock.sendmsg([msg], anc)
                return
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(self.sock, ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_writer(self.sock)

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def kill(self) -> None:
        self.dead = True
        with contextlib.suppress(OSError):
            self.sock.close()  # EOF: the zygote exits, its supervisors and their executions die with it
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


async def _read_to_eof(fd: int, timeout: float) -> bytes:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()
    buf = bytearray()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        if chunk:
            buf.extend(chunk)
        elif not done.done():
            done.set_result(bytes(buf))

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    try:
        return await asyncio.wait_for(done, timeout)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


class SandboxPool:
    """Isolated execution of untrusted code with warm interpreters. Use on one event loop::

    async with SandboxPool(SandboxPoolConfig()) as pool:
        result = await pool.execute(ExecRequest(code=src, tests=[TestCase(expr="f(1)", expected=2)]))
    """

    def __init__(self, config: SandboxPoolConfig | None = None) -> None:
        self.config = config or SandboxPoolConfig()
        self._num_zygotes = self.config.zygotes or max(1, len(os.sched_getaffinity(0)) // 8)
        self._zygotes: list[_Zygote | None] = [None] * self._num_zygotes
        self._next = 0
        n = self.config.max_concurrency
        self.uid_base = base = self.config.uid_base or 100_000 + (os.getpid() % 500_000) * UIDS_PER_PROCESS
        self._free_uids = list(range(base + n - 1, base - 1, -1))
        self._free_leases = list(range(base + n + NUM_LEASES - 1, base + n - 1, -1))
        self._slots = asyncio.Semaphore(n)
        self._workspaces: dict[str, Workspace] = {}
        self._spawn_locks = [asyncio.Lock() for _ in range(self._num_zygotes)]
        self._path = _sandbox_path(self.config.python or sys.executable)
        self._tmp = Path(tempfile.mkdtemp(prefix="prime-sandbox-"))
        (self._tmp / "root").mkdir()
        self.workspaces = self._tmp / "ws"
        self.workspaces.mkdir(mode=0o700)
        weakref.finalize(self, shutil.rmtree, self._tmp, True)  # also at interpreter exit without close()
        self.closed = False

    @property
    def num_zygotes(self) -> int:
        return self._num_zygotes

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Start every zygote (a cold start: interpreter, namespaces, root filesystem, pre-imports), side by side:
        a host with many cores runs several, and starting them in turn multiplied the cold start."""
        await asyncio.gather(*(self._zygote(i) for i in range(self._num_zygotes)))

    async def _zygote(self, i: int) -> _Zygote:
        z = self._zygotes[i]
        if z is not None and z.alive():
            return z
        async with self._spawn_locks[i]:
            z = self._zygotes[i]
            if z is None or not z.alive():
                if z is not None:
                    logger.warning("sandbox zygote %d died (exit %s); starting a new one", i, z.proc.poll())
                    await asyncio.to_thread(z.kill)
                num_uids = self.config.max_concurrency + NUM_LEASES
                z = await asyncio.to_thread(_Zygote, self.config, self.uid_base, self.workspaces, num_uids)
                self._zygotes[i] = z
            return z

    async def execute(self, request: ExecRequest) -> ExecResult:
        """Run one request; every failure of the code (and of the sandbox) is a result, never an exception."""
        if self.closed:
            raise RuntimeError("the sandbox pool is closed")
        limits = request.limits or self.config.limits
        workspace = None
        if request.workspace is not None:
            workspace = self._workspaces.get(request.workspace)
            if workspace is None:
                return ExecResult(status="sandbox_error", reason=f"no open workspace {request.workspace!r}")
        await self._slots.acquire()
        uid = workspace.uid if workspace else self._free_uids.pop()
        settled = False
        try:
            raw = await self._roundtrip(request, limits, uid, workspace)
            settled = raw.get("status") != "sandbox_error"
        finally:
            if settled:
                self._release(uid, workspace)
            else:  # cancelled or lost: it may still run under this uid, so lend the uid again after its wall limit
                asyncio.get_running_loop().call_later(limits.wall_s + QUARANTINE_SLACK_S, self._release, uid, workspace)
        return self._result(request, raw)

    def _release(self, uid: int, workspace: Workspace | None) -> None:
        if workspace is None:
            self._free_uids.append(uid)
        self._slots.release()

    async def _roundtrip(self, request: ExecRequest, limits: SandboxLimits, uid: int, ws: Workspace | None) -> dict:
        msg = {
            "code": request.code,
            "argv": request.argv,
            "tests": [t.expr for t in request.tests],
            "limits": limits.model_dump(),
            "env": request.env,
            "uid": uid,
            "path": self._path,
            "workspace": ws.name if ws else None,
        }
        body = json.dumps(msg).encode()
        for attempt in (0, 1):  # a zygote found dead at send time is replaced once; nothing has run yet
            i = self._next = (self._next + 1) % self._num_zygotes
            try:
                zygote = await self._zygote(i)
            except (SandboxUnavailable, OSError) as e:  # a replacement failed to start: this request fails alone
                return {"status": "sandbox_error", "reason": f"sandbox worker cannot start: {e}"}
            r, w = os.pipe()
            fds = [w]
            if request.stdin is not None:
                fds.append(os.memfd_create("stdin"))
                os.write(fds[1], request.stdin.encode())
                os.lseek(fds[1], 0, os.SEEK_SET)
            try:
                await zygote.send(body, fds)
            except OSError as e:
                os.close(r)
                zygote.dead = True
                if attempt:
                    return {"status": "sandbox_error", "reason": f"sandbox worker unreachable: {e}"}
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            break
        try:
            raw = await _read_to_eof(r, limits.wall_s + RESULT_SLACK_S)
        except TimeoutError:
            return {"status": "sandbox_error", "reason": "no verdict from the sandbox worker in time"}
        if not raw:
            return {"status": "sandbox_error", "reason": "the sandbox worker died during the execution"}
        return json.loads(raw)

    def _result(self, request: ExecRequest, raw: dict) -> ExecResult:
        lines = raw.pop("tests", None) or []
        result = ExecResult.model_validate(raw)
        if request.tests:
            result.tests = judge(request.tests, lines)
        return result

    async def run(
        self,
        code: str,
        *,
        stdin: str | None = None,
        tests: list | None = None,
        limits: SandboxLimits | None = None,
    ) -> ExecResult:
        """The direct form: ``await pool.run(code, tests=[TestCase(...)], limits=SandboxLimits(wall_s=2))``."""
        return await self.execute(ExecRequest(code=code, stdin=stdin, tests=tests or [], limits=limits))

    def open_workspace(self) -> str:
        """A persistent /work for a series of executions (a verifiers runtime); its name goes in
        ``ExecRequest.workspace``; give it back with :meth:`close_workspace`."""
        if not self._free_leases:
            raise RuntimeError(f"all {NUM_LEASES} sandbox workspaces are in use")
        uid = self._free_leases.pop()
        name = f"ws{uid}"
        path = self.workspaces / name
        path.mkdir(mode=0o700)
        os.chown(path, uid, uid)
        self._workspaces[name] = Workspace(name=name, path=path, uid=uid)
        return name

    def close_workspace(self, name: str) -> None:
        ws = self._workspaces.pop(name, None)
        if ws is not None:
            shutil.rmtree(ws.path, ignore_errors=True)
            self._free_leases.append(ws.uid)

    async def close(self) -> None:
        self.closed = True
        for z in self._zygotes:
            if z is not None:
                await asyncio.to_thread(z.kill)
        self._zygotes = [None] * self._num_zygotes
        shutil.rmtree(self._tmp, ignore_errors=True)
