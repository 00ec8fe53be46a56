"""The local sandbox pool: warm zygotes (see :mod:`zygote`) and the asyncio side that feeds them.

An execution costs a request memfd and a few descriptors sent to a zygote, a fork there, and one JSON verdict
back; no interpreter starts. Each running execution holds a slot, a host uid and a cgroup of its own
(:mod:`leases`). Requests over the pool's size limits end as ``error`` before anything is sent. A zygote that dies,
or that forks nothing for ``hang_timeout_s`` while requests wait, is killed and replaced: requests it never forked
are retried once on its replacement, and the executions it was running end as ``sandbox_error`` saying so.
:meth:`SandboxPool.health` gives the counters a launcher watches for progress; inside a run the pool also writes them to
its progress file (:mod:`.liveness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig

from prime_orchestrator.sandbox.cgroups import FDS_PER_KEY, Cgroups, lift_open_files
from prime_orchestrator.sandbox.diskio import bound_paths, pool_limits, read_devices
from prime_orchestrator.sandbox.leases import NUM_WORKSPACES, Lease, Leases, Workspace
from prime_orchestrator.sandbox.liveness import REAP_WAIT_S, PoolProgress
from prime_orchestrator.sandbox.relay import HOST_FDS, Relay
from prime_orchestrator.sandbox.schemas import (
    ExecRequest,
    ExecResult,
    SandboxHealth,
    judge,
    longest_line,
    parse_test_lines,
)
from prime_orchestrator.sandbox.stale import owned_name, sweep
from prime_orchestrator.sandbox.zygotes import ResultPipe, SandboxUnavailable, Zygote, sealed_memfd

__all__ = ["NUM_LEASES", "SandboxPool", "SandboxUnavailable"]

logger = logging.getLogger(__name__)
OTHER_FDS = 1024  # the env server's own: sockets, zygote pipes, HTTP clients, tool servers
NUM_LEASES = NUM_WORKSPACES
UIDS_PER_PROCESS = 8192  # 1 + max_concurrency + NUM_WORKSPACES fit in it
# A verdict later than its wall limit plus this is lost: the supervisor enforces the wall limit itself, so this only
# covers forking and tearing down on an overloaded node. Then the pool kills the supervisor and reaps the execution.
RESULT_SLACK_S = 30.0


def _sandbox_path(python: str) -> str:
    bindir = str(Path(python).resolve().parent)
    return ":".join(dict.fromkeys([bindir, "/usr/local/bin", "/usr/bin", "/bin"]))


def _abandon(zygotes: list[Zygote | None], cgroups: Cgroups) -> None:
    """A pool's teardown when it was never closed: its zygotes were alive in its CPU cgroup, which stayed."""
    for z in zygotes:
        if z is not None:
            z.kill()
    cgroups.close()


@dataclass
class _Job:
    request: ExecRequest
    limits: SandboxLimits
    lease: Lease
    verdict: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pipe: ResultPipe | None = None
    cancelled: bool = False
    cgroup_fds: list[int] = field(default_factory=list)  # the slot's, kept open by Cgroups (see _enter_cgroups)
    relay: Relay | None = None  # a program execution's routes (see relay.py)

    def kill_supervisor(self) -> None:
        """SIGKILL the execution's supervisor (its runner and the whole PID namespace die with it)."""
        if self.pipe is not None and not self.pipe.data:
            self.pipe.kill()


class SandboxPool:
    """Isolated execution of untrusted code with warm interpreters. Use on one event loop::

    async with SandboxPool(SandboxPoolConfig()) as pool:
        result = await pool.execute(ExecRequest(code=src, tests=[TestCase(expr="f(1)", expected=2)]))
    """

    def __init__(self, config: SandboxPoolConfig | None = None) -> None:
        self.config = c = config or SandboxPoolConfig()
        self._num_zygotes = c.zygotes or max(1, len(os.sched_getaffinity(0)) // 8)
        self._zygotes: list[Zygote | None] = [None] * self._num_zygotes
        self._spawn_locks = [asyncio.Lock() for _ in range(self._num_zygotes)]
        self._next = 0
        self.uid_base = c.uid_base or 100_000 + (os.getpid() % 500_000) * UIDS_PER_PROCESS
        self._path = _sandbox_path(c.python or sys.executable)
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="prime-sandbox-"))
        (self.tmp_dir / "root").mkdir()
        weakref.finalize(self, shutil.rmtree, self.tmp_dir, True)  # also at interpreter exit without close()
        self.unenforced: list[str] = []
        self._disk = None  # the executions' disk read limits (see diskio), with the cgroups
        self._seccomp = self._compile_filter()
        self._cgroups = self._make_cgroups()
        if self._cgroups is not None:  # a pool never closed (dropped, or left at exit): its zygotes first
            weakref.finalize(self, _abandon, self._zygotes, self._cgroups)
        self._leases = Leases(c.max_concurrency, self.uid_base, self._cgroups)
        self._workspaces: dict[str, Workspace] = {}
        self._tasks: set[asyncio.Task] = set()
        self._counts = dict.fromkeys(
            ("zygotes_started", "zygotes_replaced", "executions_started", "executions_completed", "sandbox_errors"), 0
        )
        self.closed = False
        self._progress = PoolProgress(c, self.health, RESULT_SLACK_S)
        if self.unenforced:
            logger.warning("sandbox pool: not enforced on this host: %s", "; ".join(self.unenforced))

    def _compile_filter(self) -> bytes | None:
        if not self.config.seccomp:
            self.unenforced.append("system-call filter (pool.seccomp = false)")
            return None
        from prime_orchestrator.sandbox.seccomp import SeccompUnavailable, compile_filter

        try:
            return compile_filter()
        except SeccompUnavailable as e:
            raise SandboxUnavailable(str(e)) from None

    def _make_cgroups(self) -> Cgroups | None:
        what = "memory of an execution's processes and files together, its process count, CPU time and disk reads"
        if not self.config.cgroups:
            self.unenforced.append(f"{what} (pool.cgroups = false)")
            return None
        devices, hidden = read_devices(bound_paths(self.config))
        cgroups, why = Cgroups.detect(owned_name(self.tmp_dir.name), io=bool(devices))
        if cgroups is not None and (removed := sweep({p.parent for p in cgroups.parents.values()}, cgroups.dirs())):
            logger.info("sandbox pool: removed %d empty cgroups of sandbox pools that are gone", removed)
        if cgroups is None:
            self.unenforced.append(f"{what} ({why}); RLIMIT_AS, RLIMIT_CPU per process and sized tmpfs still apply")
            return None
        cgroups.limit_total(self.config.total_memory_mb)
        if cgroups.no_tasks:  # a uid per slot (see leases): RLIMIT_NPROC still bounds each execution alone
            self.unenforced.append(
                f"the host-wide task cap, half the host's tasks for the executions of all its pools together (no pids "
                f"cgroup: {cgroups.no_tasks}); RLIMIT_NPROC of each execution's own uid still bounds its processes and threads"
            )
        self._disk = pool_limits(cgroups, devices, hidden, self.config, self.unenforced)
        if not cgroups.counts_cpu:
            self.unenforced.append("CPU time of an execution's processes together (no cgroup v1 cpuacct hierarchy)")
        if cgroups.cpu_parent is None:
            self.unenforced.append(
                "one CPU weight per execution and for the whole sandbox: CPU goes per process, and sessions the code "
                "makes weigh as much as a host session (no cpu cgroup)"
            )
        # Every slot's and workspace's cgroup files stay open: under a soft limit of 1024 a pool of ~300 slots
        # failed its executions once enough slots had been used, well into a run.
        # Relays (harness programs only) are asked for too but not warned about: past the limit a program's extra
        # connection is refused, where a slot's cgroup file that cannot be opened fails its execution.
        keys, slots = self.config.max_concurrency + NUM_WORKSPACES, self.config.max_concurrency
        lift_open_files(FDS_PER_KEY * keys + HOST_FDS * slots + OTHER_FDS)
        if short := lift_open_files(FDS_PER_KEY * keys + OTHER_FDS):
            logger.warning(
                "sandbox pool: %s, and its cgroups keep %d per slot and workspace (%d slots, up to %d workspaces): "
                "raise `ulimit -n` or lower pool.max_concurrency", short, FDS_PER_KEY, self.config.max_concurrency,
                NUM_WORKSPACES,
            )  # fmt: skip
        return cgroups

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
        self._progress.start()

    def health(self) -> SandboxHealth:
        """Counters a launcher can poll: executions completing while some run is progress."""
        alive = sum(1 for z in self._zygotes if z is not None and z.alive())
        return SandboxHealth(
            zygotes=alive,
            running=self._leases.in_use,
            quarantined=self._leases.quarantined,
            unenforced=self.unenforced,
            **self._counts,
        )

    async def _zygote(self, i: int) -> Zygote:
        z = self._zygotes[i]
        if z is not None and z.alive():
            return z
        async with self._spawn_locks[i]:
            z = self._zygotes[i]
            if z is None or not z.alive():
                if z is not None:
                    await self._retire(i, z, f"died (exit {z.proc.poll()})")
                num_uids = self.config.max_concurrency + NUM_WORKSPACES
                root = self.tmp_dir / "root"
                z = await asyncio.to_thread(
                    Zygote, self.config, self.uid_base, num_uids, root, self._seccomp, self._num_zygotes
                )
                if (
                    self._cgroups is not None
                    and self._cgroups.cpu_parent
                    # off the loop: a v1 cgroup.procs write waits for an RCU grace period (ms on a loaded host)
                    and (why := await asyncio.to_thread(self._cgroups.place_zygote, z.proc.pid))
                ):
                    logger.warning("sandbox zygote: %s; sessions of the code get their own CPU weight", why)
                self._zygotes[i] = z
                self._counts["zygotes_started"] += 1
            return z

    async def _retire(self, i: int, z: Zygote, why: str) -> None:
        """Kill a dead or hung zygote (once, however many requests found it so); the next request starts another."""
        if z.retired:
            return
        z.retired = True
        if self._zygotes[i] is z:
            self._zygotes[i] = None
        self._counts["zygotes_replaced"] += 1
        logger.warning("sandbox zygote %d (pid %d) %s; replacing it", i, z.proc.pid, why)
        await asyncio.to_thread(z.kill)

    async def execute(self, request: ExecRequest, routes: list[int] | None = None) -> ExecResult:
        """Run one request; every failure of the code (and of the sandbox) is a result, never an exception.
        ``routes``: run it as a harness program, with the packages the pool offers programs on its ``sys.path``
        (:mod:`programs`) and these ports of the host's ``127.0.0.1`` reachable at the same address inside
        (:mod:`relay`), and nothing else of the network."""
        if self.closed:
            raise RuntimeError("the sandbox pool is closed")
        if problem := request.not_text() or request.oversized(self.config):
            return ExecResult(status="error", reason=problem)
        workspace = None
        if request.workspace is not None:
            workspace = self._workspaces.get(request.workspace)
            if workspace is None:
                return ExecResult(status="sandbox_error", reason=f"no open workspace {request.workspace!r}")
            if workspace.zygote not in self._zygotes:
                return ExecResult(
                    status="sandbox_error", reason=f"workspace {workspace.name} was lost with its sandbox worker"
                )
        lease = await self._leases.acquire(workspace)
        relay = None
        if routes is not None:
            members = (lambda cg=self._cgroups, key=lease.cgroup: cg.pids(key)) if self._cgroups is not None else None
            relay = Relay(routes, members)
        job = _Job(request, request.limits or self.config.limits, lease, relay=relay)
        task = asyncio.ensure_future(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            raw = await job.verdict  # cancelling the caller cancels this future only; _run goes on
        except asyncio.CancelledError:  # the execution may still run: stop it; _run reaps it before the slot returns
            job.cancelled = True
            job.kill_supervisor()
            raise
        return self._result(request, raw)

    async def _run(self, job: _Job) -> None:
        self._counts["executions_started"] += 1
        self._progress.started(id(job), job.limits.wall_s)
        try:
            raw, clean = await self._roundtrip(job)
        except Exception as e:  # a bug of the pool's own: the execution ends as a sandbox error, the pool goes on
            logger.exception("sandbox execution failed")
            raw, clean = {"status": "sandbox_error", "reason": f"sandbox pool: {type(e).__name__}: {e}"}, False
        finally:
            self._progress.finished(id(job))
            if job.relay is not None:  # its listeners and connections end with the execution
                job.relay.close()
        # A verdict written before the killed PID namespace was gone (supervisor.REAP_S): processes of it still wait
        # out an uninterruptible call, so the slot is reaped like one that had no verdict.
        reaped = clean and not raw.pop("unreaped", False)
        if clean and self._cgroups is not None:
            self._memory_verdict(raw, job)
        self._counts["sandbox_errors" if raw["status"] == "sandbox_error" else "executions_completed"] += 1
        if not job.verdict.done():
            job.verdict.set_result(raw)
        if job.pipe is not None:
            job.pipe.close()
        if reaped:  # the supervisor saw the PID namespace's init reaped, so nothing of it is left
            try:
                await self._leases.settle(job.lease)
            finally:
                self._leases.release(job.lease)
        else:
            await self._leases.reap_and_release(job.lease)

    def _memory_verdict(self, raw: dict, job: _Job) -> None:
        key = job.lease.cgroup
        raw["memory_peak_mb"] = self._cgroups.peak_mb(key)
        if raw.get("exit_code") == -9 and raw["status"] == "error" and self._cgroups.oom_killed(key):
            raw.update(status="memory_limit", reason=f"memory limit of {job.limits.memory_mb} MB exceeded")
        if raw["status"] == "memory_limit" and (why := self._cgroups.total_reason(key)):
            raw["reason"] = f"{why} exceeded"

    def _enter_cgroups(self, job: _Job) -> None:
        """Set the slot's limits; its descriptors for the execution: ``cgroup.procs`` (the runner joins them), then
        the CPU counter, the OOM eventfd, the memory usage and a program's commands (the supervisor's, in order)."""
        if (cg := self._cgroups) is not None:
            key, limits, ws = job.lease.cgroup, job.limits, job.lease.workspace
            mb = limits.memory_mb + (ws.disk_mb if ws else limits.disk_mb)
            job.cgroup_fds = [*cg.enter(key, mb, limits.processes)]  # first: it makes the key's cgroups
            if self._disk is not None:
                self._disk.limit(key, limits.disk_read_mbps, limits.disk_read_iops)
            supervisor_fds = (cg.cpu_fd(key), cg.oom_event(key), cg.oom_usage(key))
            job.cgroup_fds += [fd for fd in supervisor_fds if fd is not None]
            if job.relay is not None:  # a harness program's, sent after those: its commands (supervisor.Commands)
                job.cgroup_fds += cg.commands_fds(key)

    def _body(self, job: _Job) -> bytes:
        self._enter_cgroups(job)
        request, ws = job.request, job.lease.workspace
        return json.dumps(
            {
                "code": request.code,
                "argv": request.argv,
                "tests": [t.expr for t in request.tests],
                "limits": job.limits.model_dump(),
                "env": request.env,
                "uid": job.lease.uid,
                "path": self._path,
                "workspace": ws.name if ws else None,
                "stdin": request.stdin is not None,
                "cpu_usage": self._cgroups is not None and self._cgroups.counts_cpu,
                "oom_event": self._cgroups is not None and self._cgroups.watches_oom(job.lease.cgroup),
                "oom_limit": self._cgroups.oom_limit(job.lease.cgroup) if self._cgroups is not None else None,
                "program": job.relay is not None,
                "commands": job.relay is not None and self._cgroups is not None,
                "listen": job.relay.ports if job.relay is not None else [],
            }
        ).encode()

    async def _pick(self, job: _Job) -> tuple[int, Zygote]:
        ws = job.lease.workspace
        if ws is not None:
            if ws.zygote not in self._zygotes or not ws.zygote.alive():
                raise OSError(f"workspace {ws.name} was lost with its sandbox worker")
            return self._zygotes.index(ws.zygote), ws.zygote
        i = self._next = (self._next + 1) % self._num_zygotes
        return i, await self._zygote(i)

    async def _roundtrip(self, job: _Job) -> tuple[dict, bool]:
        """The verdict, and whether it came from the supervisor (then nothing of the execution is left)."""
        body = self._body(job)
        for attempt in (0, 1):  # a request its zygote never forked is sent once more, to a replacement
            try:
                i, zygote = await self._pick(job)
            except (SandboxUnavailable, OSError) as e:
                return {"status": "sandbox_error", "reason": f"sandbox worker unavailable: {e}"}, True
            outcome = await self._wait(i, zygote, job) if await self._send(i, zygote, job, body) else "dropped"
            if outcome != "dropped":
                break
            job.pipe.close()
            job.pipe = None
            if attempt or job.lease.workspace is not None or job.cancelled:
                return {"status": "sandbox_error", "reason": "the sandbox worker died before running it"}, True
        if outcome == "late":
            job.kill_supervisor()
            await job.pipe.wait_eof(REAP_WAIT_S)
            limit = job.limits.wall_s + RESULT_SLACK_S
            return {"status": "sandbox_error", "reason": f"no verdict within {limit:.0f} s; execution killed"}, False
        if not job.pipe.data:
            return {"status": "sandbox_error", "reason": "the sandbox worker died during the execution"}, False
        return json.loads(job.pipe.data), True

    async def _send(self, i: int, zygote: Zygote, job: _Job, body: bytes) -> bool:
        """Hand ``job`` to ``zygote``; False when it takes nothing (dead, or hung: then it is retired)."""
        hang = self.config.hang_timeout_s
        r, w = os.pipe()
        job.pipe = ResultPipe(r, on_ack=lambda: self._forked(zygote, job))
        fds = [sealed_memfd("request", body), w]  # these are ours to close; the cgroups' stay open
        try:
            if job.request.stdin is not None:
                fds.append(sealed_memfd("stdin", job.request.stdin.encode()))
            if job.relay is not None and job.relay.ports:
                fds.append(job.relay.child())  # after stdin's, before the cgroups' (see supervisor.supervise)
            while True:
                try:
                    await zygote.send(b"x", fds + job.cgroup_fds, hang)
                    return True
                except TimeoutError:  # its queue is full: hung, unless it is forking others' requests
                    if time.monotonic() - zygote.last_progress > hang:
                        await self._retire(i, zygote, f"took no request for {hang} s (hung)")
                        return False
                except OSError:
                    zygote.dead = True
                    return False
        finally:
            for fd in fds:
                os.close(fd)

    def _forked(self, zygote: Zygote, job: _Job) -> None:
        zygote.last_progress = time.monotonic()
        if job.cancelled:
            job.kill_supervisor()

    async def _wait(self, i: int, zygote: Zygote, job: _Job) -> str:
        """``done`` (a verdict, or EOF once forked), ``dropped`` (never forked: the zygote died or hung with it
        queued, and is retired) or ``late`` (forked, no verdict within its wall limit plus the slack)."""
        hang, pipe = self.config.hang_timeout_s, job.pipe
        while not await pipe.wait_eof(hang):
            if pipe.supervisor is not None:
                remaining = pipe.acked_at + job.limits.wall_s + RESULT_SLACK_S - time.monotonic()
                return "done" if await pipe.wait_eof(max(0.0, remaining)) else "late"
            if time.monotonic() - zygote.last_progress > hang:
                await self._retire(i, zygote, f"forked nothing for {hang} s with requests waiting (hung)")
                await pipe.wait_eof(REAP_WAIT_S)  # its queue and its unforked descriptors go with it
                break
        return "dropped" if pipe.supervisor is None else "done"

    def _result(self, request: ExecRequest, raw: dict) -> ExecResult:
        text = raw.pop("test_lines", "")
        result = ExecResult.model_validate(raw)
        if request.tests:
            lines = parse_test_lines(text, len(request.tests), longest_line(request.tests))
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

    async def open_workspace(self, disk_mb: int | None = None) -> str:
        """A persistent /work of ``disk_mb`` (default: the pool's ``limits.disk_mb``) for a series of executions
        (a verifiers runtime), held in memory by one zygote; its name goes in ``ExecRequest.workspace``. Give it
        back with :meth:`close_workspace`."""
        disk_mb = disk_mb or self.config.limits.disk_mb
        uid = self._leases.open_workspace_uid()
        name = "ws-" + secrets.token_urlsafe(18)
        i = self._next = (self._next + 1) % self._num_zygotes
        try:
            zygote = await self._zygote(i)
            op = {"op": "open", "name": name, "uid": uid, "disk_mb": disk_mb}
            error = await zygote.workspace(op, self.config.hang_timeout_s)
        except BaseException:
            self._leases.unused_workspace_uid(uid)
            raise
        if error:
            self._leases.unused_workspace_uid(uid)
            raise RuntimeError(f"cannot open a sandbox workspace: {error}")
        self._workspaces[name] = Workspace(name=name, uid=uid, disk_mb=disk_mb, zygote=zygote)
        return name

    async def close_workspace(self, name: str) -> bool:
        """Drop a workspace and its files; False when no such workspace is open."""
        ws = self._workspaces.pop(name, None)
        if ws is None:
            return False
        ws.closed = True
        if ws.zygote in self._zygotes and ws.zygote.alive():
            with contextlib.suppress(OSError, TimeoutError):
                await ws.zygote.workspace({"op": "close", "name": name}, self.config.hang_timeout_s)
        task = asyncio.ensure_future(self._retire_workspace(ws))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _retire_workspace(self, ws: Workspace) -> None:
        await self._leases.close_workspace_uid(ws)
        if self._cgroups is not None:
            if self._disk is not None:  # a later workspace of this uid gets a new cgroup, unlimited
                self._disk.forget(f"w{ws.uid}")
            self._cgroups.remove(f"w{ws.uid}")

    async def close(self) -> None:
        self.closed = True
        self._progress.close()
        for z in self._zygotes:
            if z is not None:
                await asyncio.to_thread(z.kill)
        self._zygotes[:] = [None] * self._num_zygotes  # in place: the finalizer holds this list
        if self._tasks:  # each ends once its execution is reaped: the zygotes' deaths took their supervisors
            await asyncio.wait(list(self._tasks), timeout=15)
        if self._cgroups is not None:  # off the loop: it waits for the killed zygotes' supervisors to be gone
            await asyncio.to_thread(self._cgroups.close)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
