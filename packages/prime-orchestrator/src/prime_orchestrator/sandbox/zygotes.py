"""The host side of one zygote (see :mod:`zygote`): its process, control socket and liveness, and the reader of
an execution's result pipe (a fork acknowledgement line, then the verdict)."""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prime_core.config.sandbox import SandboxPoolConfig, sandbox_owned

from prime_orchestrator.sandbox.runner import SIGPENDING_PER_EXECUTION

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import zygote; zygote.main(int(sys.argv[2]), sys.argv[3])"
# The zygote's whole environment: nothing of the pool's (API keys, tokens) ever reaches its stack or its forks.
ZYGOTE_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no user namespaces, not root, ...); the message says why."""


def bytecode_cache(python: str, preload: list[str]) -> Path | None:
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
        if root.stat().st_mode & 0o777 != 0o755:  # made 0700 by an older pool, whose zygote ran as host root
            root.chmod(0o755)
        return root
    code = (
        f"import sys; sys.path.insert(0, {str(_HERE)!r}); import zygote\n"
        f"for m in {modules!r}:\n    try: __import__(m)\n    except Exception: pass"
    )
    try:
        # Readable by the zygote, which runs as an unprivileged host uid: only stdlib bytecode is kept here.
        root.mkdir(parents=True, exist_ok=True, mode=0o755)
        argv = [python, "-I", "-S", "-X", f"pycache_prefix={root}", "-c", code]
        subprocess.run(argv, check=True, timeout=120, capture_output=True, env=ZYGOTE_ENV)
        (root / "complete").touch()
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("no bytecode cache for the sandbox zygote (%s); each zygote start compiles its imports", e)
        return None
    return root


def interpreter_dirs(python: str) -> list[str]:
    """What of the interpreter's installation the sandbox binds: the binary's directory and its prefix's ``lib``
    (the standard library, its extension modules, libpython), never the whole prefix (the binary's grandparent): for
    an interpreter in ``$HOME/bin`` (``--prefix=$HOME``) that was the home, ``~/.ssh`` and every token in it."""
    binary = Path(python).resolve()
    dirs = [binary.parent, binary.parent.parent / "lib", binary.parent.parent / "lib64"]
    return [str(d) for d in dirs if d.is_dir()]


def sigpending_cap(zygotes: int) -> int | None:
    """RLIMIT_SIGPENDING of a zygote when it creates its user namespace, which the kernel keeps as the cap on the
    signals queued and POSIX timers held by all of that namespace's processes together. They count against the
    namespace creator's own: host root's. Inherited whole, one execution's 96,361 ``timer_create`` calls left host
    root none, and every root process on the host (the trainer, the inference server) got ``EAGAIN`` from
    ``timer_create`` and ``sigqueue`` until it ended. The zygotes together take at most half of it; None where the
    host does not limit it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_SIGPENDING)
    if soft == resource.RLIM_INFINITY:
        return None
    return min(soft, max(SIGPENDING_PER_EXECUTION, soft // (2 * max(1, zygotes))))


class Zygote:
    """One zygote process and its control socket (SOCK_SEQPACKET: one message per request, never split).

    ``last_progress`` is the last time it forked a request (or started): a zygote with requests waiting and no
    progress for ``hang_timeout_s`` is hung."""

    def __init__(
        self,
        config: SandboxPoolConfig,
        uid_base: int,
        num_uids: int,
        root: Path,
        seccomp: bytes | None,
        zygotes: int = 1,
    ):
        from prime_orchestrator.sandbox.programs import offered, pool_python

        python = config.python or os.path.realpath(sys.executable)
        bytecode = bytecode_cache(python, config.preload)
        programs = offered(tuple(config.program_packages))[1] if pool_python(config.python) else {}
        setup = {
            "sigpending": sigpending_cap(zygotes),
            "root": str(root),
            "ro_paths": [*interpreter_dirs(python), *config.ro_paths, *([str(bytecode)] if bytecode else [])],
            "preload": config.preload,
            "socket_walk": config.ro_paths,  # see zygote.hide_sockets
            "seccomp": base64.b64encode(seccomp).decode() if seccomp else "",
            "programs": programs,
            "owner": uid_base,  # root inside: the only one who may enter the programs' hidden directory
        }
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        flags = ["-X", f"pycache_prefix={bytecode}"] if bytecode else []
        argv = [python, "-I", "-S", *flags, "-c", _BOOT, str(_HERE), str(child.fileno()), json.dumps(setup)]
        self.proc = subprocess.Popen(argv, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=ZYGOTE_ENV)
        child.close()
        # Every supervisor and execution inherits it: when the host runs out of memory (a pool's limits add up to
        # more than the host has: 256 executions of 576 MiB by default), the kernel kills the sandbox's largest
        # process, not the trainer or the inference server, whose resident memory is far larger. Root only can
        # lower it again, and nothing inside has /proc.
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/oom_score_adj").write_text("1000")
        self.sock = parent
        self.dead = False
        self.retired = False  # the pool has given up on it (dead or hung) and counted it once
        try:
            self._handshake(config, uid_base, num_uids)
        except BaseException:
            self.kill()
            raise
        self.sock.setblocking(False)
        self.last_progress = time.monotonic()

    def _handshake(self, config: SandboxPoolConfig, base: int, num_uids: int) -> None:
        self.sock.settimeout(config.start_timeout_s)
        first = self.sock.recv(4096)
        if first != b"unshared":
            raise SandboxUnavailable(f"sandbox zygote failed: {first.decode(errors='replace') or 'exited'}")
        try:
            # Inside, 0 is the pool's first uid (unprivileged on the host); the execution uids map to themselves.
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{self.proc.pid}/{name}").write_text(f"0 {base} 1\n{base + 1} {base + 1} {num_uids}\n")
        except OSError as e:
            raise SandboxUnavailable(
                f"cannot map sandbox uids ({e.strerror}): the pool must run as root (CAP_SETUID) with user "
                "namespaces enabled"
            ) from None
        self.sock.send(b"mapped")
        reply = self.sock.recv(4096)
        if reply != b"ready":
            raise SandboxUnavailable(f"sandbox zygote failed: {reply.decode(errors='replace') or 'exited'}")

    async def send(self, msg: bytes, fds: list[int], timeout: float) -> None:
        """One message with ``fds``; TimeoutError when the zygote takes none for ``timeout`` (its queue is full)."""
        loop = asyncio.get_running_loop()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.sendmsg([msg], anc)
                return
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(self.sock, ready.set_result, None)
                try:
                    await asyncio.wait_for(ready, max(0.0, deadline - time.monotonic()))
                finally:
                    loop.remove_writer(self.sock)

    async def workspace(self, op: dict, timeout: float) -> str:
        """Open or close a workspace inside the zygote's mount namespace; '' or the error."""
        r, w = os.pipe()
        try:
            await self.send(b"w" + json.dumps(op).encode(), [w], timeout)
        finally:
            os.close(w)
        reply = ResultPipe(r)
        try:
            if not await reply.wait_eof(timeout):
                return "the sandbox worker did not answer"
        finally:
            reply.close()
        return "" if reply.data == b"ok" else (reply.data.decode(errors="replace") or "the sandbox worker died")

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


def supervisor_pidfd(pid: int, pipe_fd: int) -> int | None:
    """A pidfd of the supervisor that acknowledged on ``pipe_fd`` with ``pid``, or None when it is gone already.

    The zygote reaps its supervisors at once, so a supervisor's pid is free again as soon as it exits, and the pool
    signalled it by number: had the number been reused (a wrap of ``pid_max``) it would have killed whatever process
    got it. The pidfd is opened first, then the pipe is checked for a writer: only the supervisor holds the write end
    (the zygote closes its copy once it forked it), so while the pipe has one, the pid opened was the supervisor's."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone, and maybe its number too
        return None
    poller = select.poll()
    poller.register(pipe_fd, select.POLLIN)
    if any(event & select.POLLHUP for _, event in poller.poll(0)):
        os.close(pidfd)
        return None
    return pidfd


class ResultPipe:
    """The read end of an execution's result pipe: ``+<supervisor pid>`` once the zygote forked it (``on_ack`` is
    called then), then the verdict, then EOF."""

    def __init__(self, fd: int, on_ack=None) -> None:
        self.fd = fd
        self.supervisor: int | None = None
        self.pidfd: int | None = None  # the supervisor's (see supervisor_pidfd): what kill() signals
        self.acked_at = 0.0
        self.data = b""
        self.eof = False
        self._on_ack = on_ack
        self._buf = bytearray()
        self._waiter: asyncio.Future[bool] | None = None
        self._loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._on_readable)
        self._reading = True

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        if chunk:
            self._buf += chunk
            if self.supervisor is None and b"\n" in self._buf and self._buf[:1] == b"+":
                line, _, rest = bytes(self._buf).partition(b"\n")
                self.supervisor, self.acked_at, self._buf = int(line[1:]), time.monotonic(), bytearray(rest)
                self.pidfd = supervisor_pidfd(self.supervisor, self.fd)
                if self._on_ack is not None:
                    self._on_ack()
            return
        self.data, self.eof = bytes(self._buf), True
        self._stop()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    async def wait_eof(self, timeout: float) -> bool:
        """True at EOF (the verdict is in :attr:`data`, empty if the writer died), False after ``timeout``."""
        if self.eof:
            return True
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, lambda: waiter.done() or waiter.set_result(False))
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _stop(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.fd)

    def kill(self) -> None:
        """SIGKILL the supervisor, through its pidfd: never a process that got its pid after it exited."""
        if self.pidfd is not None and not self.eof:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        self._stop()
        for fd in (self.fd, self.pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pidfd = None


SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed_memfd(name: str, data: bytes) -> int:
    """A sealed memfd holding ``data``: the code reading it as stdin cannot grow it into memory nobody counts."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd
