"""Start a set of child processes, watch them, and stop the whole tree when one fails.

Every child runs in its own session (so its process group id is its pid and a terminal's Ctrl-C reaches
only the launcher), with ``PR_SET_PDEATHSIG`` so the kernel kills it if the launcher dies. Grandchildren
(torchrun workers, engine workers) are covered by killing the child's process group and, before that,
every descendant found under ``/proc``. A watchdog process, started first, kills every group the launcher
registered if the launcher disappears without saying goodbye (``kill -9``), which ``PDEATHSIG`` alone
cannot do for grandchildren.

A descendant in a session of its own (a harness program an env worker starts with ``setsid``) is in no child's group,
and once its parent dies (an orchestrator killed by the OOM killer) it is in no child's tree either: every child carries
``PRIME_LAUNCH_TAG`` in its environment, which its descendants inherit, and the stop and the watchdog also end every
process whose environment holds this launch's tag (before, such a process outlived the run).

Every child gets a private ``TMPDIR`` (``<temp dir>/prime-<run id>-<tag>/<name>``), removed with everything in it once
the launch's processes are gone, however they ended: by ``stop_all``, or by the watchdog after a ``kill -9`` of the
launcher. A process that had to be SIGKILLed (its main thread stuck in C past SIGTERM's grace) runs no exit handler,
and left its multiprocessing forkserver directory (``pymp-*``), vLLM's IPC sockets and the like in the shared temp
dir. Compile caches kept in the temp dir (torch inductor's, FlashAttention-4's) stay where they are by default
(`temp_dir_caches`), so they outlive the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_core.io import open_regular

from prime_launch.log_pump import LogPump

PR_SET_PDEATHSIG = 1
LAUNCH_TAG = "PRIME_LAUNCH_TAG"


@dataclass
class ProcessSpec:
    """One child: its name (used in messages and the log file name), command, environment and log file."""

    name: str
    cmd: list[str]
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the launcher's environment."""
    cwd: Path | None = None


class ProcessFailed(RuntimeError):
    """A child exited unexpectedly; carries its name, exit code and the tail of its log."""

    def __init__(self, name: str, returncode: int | None, log_file: Path, reason: str = ""):
        self.name = name
        self.returncode = returncode
        self.log_file = log_file
        self.reason = reason or f"exited with code {returncode}"
        super().__init__(f"{name} {self.reason}")

    @property
    def cause(self) -> str:
        """One line: which process ended and how (with the ``error:`` line it printed last, if any), and its log."""
        said = last_error_line(self.log_file)
        return f"{self.name} {self.reason}{f': {said}' if said else ''} (log: {self.log_file})"

    def log_tail(self, num_lines: int = 30) -> str:
        """The last lines of the process's log, framed ("" for an empty log)."""
        tail = tail_lines(self.log_file, num_lines)
        if not tail:
            return ""
        return "\n".join([f"---- last {len(tail)} lines of {self.log_file.name} ----", *tail, "----"])


def full_disk_note(path: Path, min_free: int = 1 << 20) -> str | None:
    """A line saying the file system of ``path`` is full (under ``min_free`` bytes left), else None. A child
    that died of a full disk could not write why into its log there: the launcher says it."""
    import shutil

    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free >= min_free:
        return None
    return f"No space left on device (errno 28 ENOSPC): {path} has {free} bytes free (its logs may be cut off)"


def last_error_line(path: Path, num_lines: int = 30) -> str | None:
    """The last ``error: ...`` line among a log's last lines (how an entry point names a fault), without the prefix."""
    said = [line for line in tail_lines(path, num_lines) if line.startswith("error: ")]
    return said[-1].removeprefix("error: ").strip()[:500] if said else None


def tail_lines(path: Path, num_lines: int) -> list[str]:
    """The last ``num_lines`` lines of a (possibly large) text file; [] if it does not exist."""
    try:
        with open_regular(path) as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [line for line in data.decode(errors="replace").splitlines()][-num_lines:]


def _set_pdeathsig() -> None:
    """Runs in the child between fork and exec: die with SIGKILL when the launcher thread dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog still covers us
        pass


def _proc_table() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgrp, state) of every process in /proc."""
    table = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3:
            table.append((int(entry), int(rest[1]), int(rest[2]), rest[0]))
    return table


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for child, ppid, _, state in _proc_table():
        if state != "Z":
            children.setdefault(ppid, []).append(child)
    found, queue = [], deque(children.get(pid, []))
    while queue:
        child = queue.popleft()
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def tagged(tag: str) -> set[int]:
    """Live processes whose environment (as they were started) holds ``PRIME_LAUNCH_TAG=<tag>``: a launch's
    descendants, wherever they were reparented and whichever session they made."""
    marker = f"{LAUNCH_TAG}={tag}".encode()
    found = set()
    for pid, _, _, state in _proc_table():
        if state == "Z" or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.add(pid)
    return found


def _live_pids(pids: set[int], pgids: set[int]) -> list[int]:
    """Processes (not zombies) among ``pids`` or in one of the groups ``pgids``."""
    return [pid for pid, _, pgrp, state in _proc_table() if state != "Z" and (pid in pids or pgrp in pgids)]


def _signal_tree(pid: int, pgid: int, sig: int) -> None:
    for target in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)
            if sig == signal.SIGTERM:  # a stopped process (SIGSTOP) handles SIGTERM only once continued
                os.kill(target, signal.SIGCONT)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
        if sig == signal.SIGTERM:
            os.killpg(pgid, signal.SIGCONT)


# Runs as `python -c`: reads "add <pgid>", "del <pgid>" and "exit" lines; on EOF without "exit" (the launcher
# died) it stops every registered group and every process tagged with the launch's tag (argv[2]): SIGTERM, then
# SIGKILL after the grace period; then it removes the children's temp dirs (argv[3]).
_WATCHDOG = r"""
import os, shutil, signal, sys, time
grace = float(sys.argv[1])
marker = ("PRIME_LAUNCH_TAG=" + sys.argv[2]).encode()
def tagged():
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/" + entry + "/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found
def kill(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
            if sig == signal.SIGTERM:
                os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
groups = set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "add":
        groups.add(int(arg))
    elif cmd == "del":
        groups.discard(int(arg))
    elif cmd == "exit":
        sys.exit(0)
def alive(g):
    # A member that is a zombie is gone: an init that does not reap orphans must not keep the lock held for the bound.
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/" + entry + "/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[2]) == g and rest[0] != "Z":
            return True
    return False
for g in groups:
    try:
        os.killpg(g, signal.SIGTERM)
    except OSError:
        pass
kill(tagged(), signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and (any(alive(g) for g in groups) or tagged()):
    time.sleep(0.1)
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
kill(tagged(), signal.SIGKILL)
gone_by = time.monotonic() + 2.0  # a SIGKILL is delivered, not done: the lock this holds goes when they are gone
while time.monotonic() < gone_by and (any(alive(g) for g in groups) or tagged()):
    time.sleep(0.05)
shutil.rmtree(sys.argv[3], ignore_errors=True)
"""


MAX_SOCKET_PATH = 107
SOCKET_ROOM = 48
"""Bytes a private TMPDIR leaves for what goes under it: ``pymp-XXXXXXXX/listener-XXXXXXXX`` (32), vLLM's
``/<uuid4>`` IPC sockets (37)."""


def _short(name: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:limit]


def temp_dir_caches() -> dict[str, str]:
    """Compile caches that live in the temp dir by default, where the launcher sees it: a child's private TMPDIR must
    not move them (they would be built again every run, and removed with it). torch inductor's
    (``torch._inductor``'s ``default_cache_dir``) and FlashAttention-4's CuTe-DSL kernels (``flash_attn.cute``'s
    ``get_cache_path``, used under ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``)."""
    user = getpass.getuser()
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(
            tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
        ),
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": os.path.join(
            tempfile.gettempdir(), user, "flash_attention_cute_dsl_cache"
        ),
    }


class ProcessManager:
    """Owns the children of one launch. Use as a context manager: leaving it always stops everything.

    ``start`` launches a child with stdout and stderr going to its log file (bounded: `prime_launch.log_pump`). ``poll`` raises
    ``ProcessFailed`` for the first child that died unexpectedly. ``stop_all`` sends SIGTERM to every
    group, waits ``grace_s`` and then SIGKILLs what is left, so a stop takes at most ``grace_s`` plus a
    fraction of a second.
    """

    def __init__(
        self,
        grace_s: float = 5.0,
        watchdog: bool = True,
        liveness: Any = None,
        hold_fds: tuple[int, ...] | list[int] = (),
        run_id: str | None = None,
        max_log_bytes: int = 1 << 30,
    ):
        self.grace_s = grace_s
        self.max_log_bytes = max_log_bytes
        """A child's log past this size moves to ``<name>.log.1`` and starts again (``prime_launch.log_pump``)."""
        self.liveness = liveness
        """``prime_launch.watchdog.RunWatchdog``: told of every start, checked on every ``poll`` (``ProcessStuck``)."""
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ProcessSpec] = {}
        self.finished: dict[str, int] = {}
        """Children that exited and were accepted (expected exit), name -> return code."""
        self._pumps: list[LogPump] = []
        self._watchdog: subprocess.Popen | None = None
        self.tag = secrets.token_hex(8)
        """Set as ``PRIME_LAUNCH_TAG`` in every child's environment: finds descendants outside every tree and group."""
        self.temp_root = Path(tempfile.gettempdir()) / f"prime-{_short(run_id or 'run', 12)}-{self.tag[:8]}"
        """Holds each child's private ``TMPDIR`` (made at its start); removed once the processes are gone."""
        if watchdog:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(grace_s), self.tag, str(self.temp_root)],
                # The output directory's lock (``hold_fds``) is held by the watchdog too: after a kill -9 of rl it is
                # free only once the processes the watchdog stops are gone. Before, a relaunch (a supervisor's
                # `rl --resume`) took it at once and rewound the directory while they still wrote there.
                pass_fds=tuple(hold_fds),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
            )

    def __enter__(self) -> ProcessManager:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        self.close()

    def _tell_watchdog(self, message: str) -> None:
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        try:
            self._watchdog.stdin.write(message + "\n")
            self._watchdog.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def start(self, spec: ProcessSpec, *, append_log: bool = False) -> subprocess.Popen:
        if spec.name in self.procs:
            raise ValueError(f"a process named {spec.name!r} is already running")
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env, LAUNCH_TAG: self.tag}
        if "TMPDIR" not in spec.env and (private := self._private_temp_dir(spec.name)) is not None:
            env = {**temp_dir_caches(), **env}
            env["TMPDIR"] = str(private)
        read_fd, write_fd = os.pipe()
        try:
            pump = LogPump(read_fd, spec.log_file, self.max_log_bytes, append=append_log)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        try:
            proc = subprocess.Popen(
                spec.cmd,
                stdin=subprocess.DEVNULL,
                stdout=write_fd,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_set_pdeathsig,
            )
        finally:
            os.close(write_fd)  # the child's (and its descendants') copies are the pipe's writers now
            self._pumps.append(pump.start())
        self.procs[spec.name] = proc
        self.specs[spec.name] = spec
        self._tell_watchdog(f"add {proc.pid}")
        if self.liveness is not None:
            self.liveness.started(spec.name, proc.pid)
        return proc

    def _private_temp_dir(self, name: str) -> Path | None:
        """The child's TMPDIR, made now; None (the temp dir as it is) when its path leaves too little room for the
        sockets made in it: a Unix socket's path has at most 107 bytes, and a forkserver's listener was refused."""
        path = self.temp_root / _short(name, 24)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH - SOCKET_ROOM:
            return None
        self.temp_root.mkdir(mode=0o700, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def running(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is None]

    def poll(self, expected_exits: dict[str, bool] | None = None) -> str | None:
        """Check every child once. Raise ``ProcessFailed`` for an unexpected exit.

        ``expected_exits[name]`` says whether exiting with code 0 is normal for that child. Returns the
        name of a child that just finished normally, else None.
        """
        expected_exits = expected_exits or {}
        for name, proc in self.procs.items():
            if name in self.finished:
                continue
            code = proc.poll()
            if code is None:
                continue
            if code == 0 and expected_exits.get(name, False):
                self.finished[name] = code
                return name
            reason = f"exited with code {code}" if code >= 0 else f"was killed by {_signal_name(-code)}"
            if code == 0:
                reason = "exited (code 0) before the run finished"
            raise ProcessFailed(name, code, self.specs[name].log_file, reason)
        if self.liveness is not None:
            self.liveness.check(self.finished)  # alive is not enough: raises ProcessStuck for one that is stuck
        return None

    def stop_all(self) -> float:
        """Stop every child and its descendants; return the seconds it took."""
        start = time.monotonic()
        if self.liveness is not None:
            self.liveness.close()
        pgids = {p.pid for p in self.procs.values()}
        # Remember descendants before the parents die: orphans are reparented and would be lost to the walk. The tag
        # finds those already lost (their parent died before the stop) in sessions of their own.
        tree = {pid for p in self.procs.values() for pid in [p.pid, *descendants(p.pid)]}
        strays = tagged(self.tag) - set(_live_pids(tree, pgids))
        tree |= strays
        if _live_pids(tree, pgids):
            for p in reversed(list(self.procs.values())):
                _signal_tree(p.pid, p.pid, signal.SIGTERM)
            for pid in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
                    os.kill(pid, signal.SIGCONT)
            deadline = start + self.grace_s
            while time.monotonic() < deadline:
                for p in self.procs.values():
                    p.poll()
                if not _live_pids(tree, pgids):
                    break
                time.sleep(0.05)
            tree |= tagged(self.tag)  # started while the others stopped
            for pid in _live_pids(tree, pgids):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for pgid in pgids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            # SIGKILL is delivered, not done: a process with much memory takes a moment to go, and a descendant still
            # exiting when rl returns looked like a leaked process (the kill-and-resume test saw one, 1 run in 4).
            gone_by = time.monotonic() + 2.0
            while time.monotonic() < gone_by and _live_pids(tree, pgids):
                for p in self.procs.values():
                    p.poll()
                time.sleep(0.02)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2)
            self._tell_watchdog(f"del {p.pid}")
        # Each child's TMPDIR: what a SIGKILLed process could not remove itself (multiprocessing's pymp-* directory).
        shutil.rmtree(self.temp_root, ignore_errors=True)
        return time.monotonic() - start

    def close(self) -> None:
        """Finish the logs and let the watchdog go (only after ``stop_all``)."""
        deadline = time.monotonic() + 2.0  # a stray that kept the pipe open (no tag, no tree) is not waited for
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        self._pumps.clear()
        if self._watchdog is not None:
            self._tell_watchdog("exit")
            try:
                if self._watchdog.stdin:
                    self._watchdog.stdin.close()
                self._watchdog.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                self._watchdog.kill()
            self._watchdog = None


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
