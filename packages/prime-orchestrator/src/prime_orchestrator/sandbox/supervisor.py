"""One execution, forked from the zygote: the supervisor (trusted), which forks the runner (:mod:`runner`).

The supervisor says it was forked (one line on the result pipe, with its host pid, so the pool can tell a hung
zygote from a slow execution and kill this process if it ever stops answering), reads its request from the memfd
the pool wrote, enters fresh mount, PID, IPC and network namespaces, mounts the execution's private tmpfs (or its
workspace) on ``/work`` and forks the runner, which becomes PID 1 of its PID namespace: when it ends, the kernel
kills every process it left behind and returns from ``wait4`` only once they are all gone, so nothing of the
execution outlives the verdict and its uid can be lent again at once. (A killed namespace held by an uninterruptible
wait is waited for :data:`REAP_S` at most: its verdict then says ``unreaped`` and the pool reaps the slot.)

The deadline watches the runner itself (a pidfd), not its pipes: closing stdout, stderr and the test channel does
not stop the clock. Output past the cap also ends it. The verdict is one JSON object on the result pipe; the test
channel goes back as text, unparsed: the pool parses it, and no line the code wrote can break this process. What the
code wrote is cut to what its JSON costs, not only to its bytes (see :func:`_fit`).

Stdlib only (imported by the zygote, see :mod:`zygote`).
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import resource
import select
import signal
import socket
import time

if __package__:
    from prime_orchestrator.sandbox import _linux as lx
    from prime_orchestrator.sandbox import runner
else:  # inside the zygote (see zygote.py)
    import _linux as lx
    import runner

# Harness programs (``SandboxPool.execute(..., routes=...)``): the packages the pool offers them are bound under
# PROGRAMS_HIDDEN (mode 0700, the namespace root's: no execution's uid may enter it), and only a program execution's
# supervisor binds that tree on PROGRAM_SITE, the directory the program's interpreter puts on its sys.path.
PROGRAMS_HIDDEN = "/.programs"
PROGRAM_SITE = "/opt/prime/site-packages"
# How long a killed execution's PID namespace may take to go before the verdict is written without it. A process in an
# uninterruptible wait outlives SIGKILL until the wait ends: 14 threads each reading a 117 MB bound file with O_DIRECT,
# queued behind the slot's 50 MB/s disk throttle, held the namespace 35 s past the kill, and the pool, given no verdict
# within wall_s + 30 s, made a 2 s execution a ``sandbox_error`` (a failed rollout, which trains nothing, where the
# code should score 0). Past this the verdict says ``unreaped`` and the pool keeps the slot until its cgroup is empty.
REAP_S = 2.0


def supervise(fds: list[int], ctl_fd: int, zygote_pid: int, seccomp) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(ctl_fd)
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before the prctl: no signal will ever come
        os._exit(0)
    request_fd, result_fd, extra = fds[0], fds[1], fds[2:]
    os.write(result_fd, b"+%d\n" % os.getpid())
    try:
        req = json.loads(os.pread(request_fd, os.fstat(request_fd).st_size, 0))
        os.close(request_fd)
        stdin_fd = extra.pop(0) if req.get("stdin") else None
        relay_fd = extra.pop(0) if req.get("listen") else None  # after stdin's: see SandboxPool._send
        commands = Commands(*reversed([extra.pop(), extra.pop()])) if req.get("commands") else None  # sent last
        usage_fd = extra.pop() if req.get("oom_limit") and extra else None  # then this one
        oom_fd = extra.pop() if req.get("oom_event") and extra else None  # then this one
        cpu_fd = extra.pop() if req.get("cpu_usage") and extra else None  # then this one
        oom = OomWatch(oom_fd, usage_fd, req.get("oom_limit")) if oom_fd is not None else None
        verdict = _execute(req, stdin_fd, extra, seccomp, cpu_fd, oom, relay_fd, commands)
        verdict["commands_killed"] = commands.killed if commands is not None else 0
    except Exception as e:  # a verdict, never a silent EOF: the pool reports it as a sandbox error
        verdict = {"status": "sandbox_error", "reason": f"supervisor: {type(e).__name__}: {e}"}
    own = resource.getrusage(resource.RUSAGE_SELF)
    verdict["supervisor_cpu_s"] = own.ru_utime + own.ru_stime
    data = json.dumps(verdict, ensure_ascii=False).encode(errors="replace")
    while data:
        data = data[os.write(result_fd, data) :]
    os.close(result_fd)  # the verdict is complete now, not after this process's namespaces are torn down
    os._exit(0)


def _mount_work(req: dict) -> None:
    lx.unshare(lx.CLONE_NEWNS | lx.CLONE_NEWPID | lx.CLONE_NEWIPC | lx.CLONE_NEWNET)
    uid, limits = req["uid"], req["limits"]
    flags = lx.MS_NOSUID | lx.MS_NODEV
    if req.get("workspace"):
        lx.mount("/.ws/" + req["workspace"], "/work", None, lx.MS_BIND)
    else:
        size = limits["disk_mb"]
        opts = f"size={size}m,nr_inodes={max(1024, size * 64)},mode=0700,uid={uid},gid={uid}"
        lx.mount("tmpfs", "/work", "tmpfs", flags, opts)
    if req.get("program"):  # the packages the pool offers harness programs (see zygote.bind_programs)
        lx.mount(PROGRAMS_HIDDEN + "/site", PROGRAM_SITE, None, lx.MS_BIND | lx.MS_REC)


def _listen(ports: list[int], relay_fd: int) -> None:
    """A program's routes: loopback up in this execution's (new, empty) network namespace, one listener on
    ``127.0.0.1:<port>`` per route, handed to the pool over ``relay_fd``; the pool accepts on them and relays each
    connection to the same port of the host's loopback, and to nothing else (:mod:`relay`). The runner never holds
    them (it closes every descriptor but its standard ones)."""
    lx.loopback_up()
    listeners = []
    try:
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listeners.append(s)
            s.bind(("127.0.0.1", port))
            s.listen(16)
        fds = array.array("i", [s.fileno() for s in listeners])
        with socket.socket(fileno=relay_fd) as relay:
            relay.sendmsg([json.dumps(ports).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    finally:
        for s in listeners:
            s.close()


class CpuClock:
    """The CPU time of every process of the execution together, from its cgroup's counter (a descriptor the pool
    opened), against the budget ``cpu_s`` rounds up to (RLIMIT_CPU's own). RLIMIT_CPU bounds each process alone: a
    chain of children, each stopping under it, ran an execution limited to 1 s for 6.4 s of CPU and ended ``ok``.

    Read when the budget could first be spent, every CPU running it flat out, so an execution cannot pass it by
    more than :data:`MIN_CHECK_S` times the CPUs between two reads: none for an execution that ends before the
    budget over the CPUs (a second for 10 s on 10 CPUs), then one per such span of what is left."""

    MIN_CHECK_S = 0.005
    GRACE_S = 0.05  # the runner's set-up before the code, and RLIMIT_CPU's own tick: a single process never trips it
    # RLIMIT_CPU, per process, then only bounds what the clock cannot stop (a supervisor starved of CPU). It must not
    # stop a process under the budget: the kernel compares it with utime+stime sampled at its ticks, not with the
    # precise time both this counter and time.process_time() read, and on a loaded VM the sample runs ahead: a child
    # burning 0.8 s of process_time under a 1 s RLIMIT_CPU ended at 0.77 s without writing its byte, and its parent,
    # blocked on their pipe, ran into the wall limit.
    BACKSTOP = 2
    # A harness program's own CPU past a budget its commands spent (see spend): verifiers' chat program used 5.3 s for
    # its start and 5 turns on the loaded 2-core VM.
    RESERVE, MIN_RESERVE_S, SPENT_CHECK_S = 0.1, 2.0, 0.05

    def __init__(self, fd: int, cpu_s: float) -> None:
        self.fd = fd
        self.budget = max(1, math.ceil(cpu_s)) + self.GRACE_S
        self.spent = False
        self.cpus = max(1, len(os.sched_getaffinity(0)))
        self.base = self._read()
        self.detected: float | None = None  # what was read when the budget was found spent (the verdict's)

    def _read(self) -> float:
        data = os.pread(self.fd, 4096, 0)
        if data.startswith(b"usage_usec"):  # cgroup v2 cpu.stat
            return int(data.split()[1]) / 1e6
        return int(data) / 1e9  # cgroup v1 cpuacct.usage

    @property
    def rlimit(self) -> int:
        """RLIMIT_CPU of each process while this clock watches the total: :data:`BACKSTOP` times the budget."""
        return math.ceil(self.BACKSTOP * self.budget)

    def used(self) -> float:
        return self._read() - self.base

    def spend(self) -> None:
        """A harness program's commands ran the budget out (see :class:`Commands`): from now on each read kills its
        commands, and the program alone may spend :data:`RESERVE` of the budget more to finish its episode."""
        if not self.spent:
            self.spent = True
            # at most half the budget more: RLIMIT_CPU (BACKSTOP times it) must not stop the program before this does
            self.budget += min(max(self.MIN_RESERVE_S, self.RESERVE * self.budget), self.budget / 2)

    def next_read(self, now: float, used: float) -> float:
        if self.spent:  # a command started now runs at most this long on every CPU before it is killed
            return now + self.SPENT_CHECK_S
        return now + max(self.MIN_CHECK_S, (self.budget - used) / self.cpus)


class Commands:
    """A harness program's commands: every process of its execution's cgroup but the program itself (the runner, PID 1
    of the namespace). At the execution's memory or CPU limit the supervisor kills them in the program's place, and
    the program goes on: its tool call returns what the command printed until then (bash adds ``Killed`` for a child
    it waited for), the episode ends and is scored. Killing the program failed the rollout, which trains nothing: a
    way out of a bad attempt's negative advantage (two 1.1 GB buffers under program_limits' 2 GiB, or two threads
    spinning through its CPU budget). With no command left the program is the one past the limit: it ends as before.

    Host pids from the slot's ``cgroup.procs`` (this process is in the host's PID namespace; the processes of a
    workspace's other executions running at that moment count as commands too), their resident memory from the
    host's ``/proc``: two descriptors the pool sent, which the runner closes before the code runs."""

    def __init__(self, members_fd: int, proc_fd: int) -> None:
        self.members_fd, self.proc_fd = members_fd, proc_fd
        self.killed = 0

    def _members(self) -> set[int]:
        return {int(p) for p in os.pread(self.members_fd, 1 << 20, 0).split()}

    def kill_all(self, program: int) -> int:
        """Kill every command (``program``: the runner's pid); how many."""
        return self._kill(self._members() - {program})

    def kill_largest(self, program: int) -> int:
        """Kill the command holding the most resident memory, the one the kernel's OOM killer would take; 0: none."""
        sizes = {}
        for pid in self._members() - {program}:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fd = os.open(f"{pid}/statm", os.O_RDONLY, dir_fd=self.proc_fd)
                try:
                    sizes[pid] = int(os.read(fd, 256).split()[1])
                finally:
                    os.close(fd)
        return self._kill([max(sizes, key=sizes.__getitem__)] if sizes else [])

    def _kill(self, pids) -> int:
        """SIGKILL those of ``pids`` still in the slot; how many. Each pidfd is opened before the slot is listed
        again, so a pid freed and taken by a process outside the slot meanwhile is never signalled."""
        fds = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                fds[pid] = os.pidfd_open(pid)
        members, killed = self._members(), 0
        for pid, fd in fds.items():
            with contextlib.suppress(OSError):
                if pid in members:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed += 1
            os.close(fd)
        self.killed += killed
        return killed


class OomWatch:
    """The slot's OOM eventfd (``Cgroups.oom_event``), and its memory usage against its ``limit`` in bytes: v1 signals
    the eventfd of every cgroup below the one at its limit, the pool's too (``Cgroups.limit_total``), where the
    kernel's OOM killer (on there) kills a process itself. Only the slot's own limit ends the execution here."""

    SLACK = 1 << 20  # the charge that failed: usage stays below the limit by at most a few pages

    def __init__(self, fd: int, usage_fd: int | None, limit: int | None) -> None:
        self.fd, self.usage_fd, self.limit = fd, usage_fd, limit

    def own(self) -> bool:
        if (
            self.usage_fd is None
            or self.limit is None
            or int(os.pread(self.usage_fd, 32, 0)) >= self.limit - self.SLACK
        ):
            return True  # left counted: every execution of a workspace at its limit (one eventfd) must see it
        self.rearm()
        return False

    def rearm(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the next OOM wakes the poll, this one does not spin it
            os.eventfd_read(self.fd)

    def breached(self, commands: Commands | None, program: int) -> bool:
        """Whether the execution is at its own limit and ends; a harness program's largest command dies in its place
        while it has one (the program goes on)."""
        if not self.own():
            return False
        if commands is not None and commands.kill_largest(program):
            self.rearm()
            return False
        return True  # a process waits at the limit (the kernel kills none here): the execution ends


def _execute(
    req: dict,
    stdin_fd: int | None,
    cgroup_fds: list[int],
    seccomp,
    cpu_fd: int | None = None,
    oom: OomWatch | None = None,
    relay_fd: int | None = None,
    commands: Commands | None = None,
) -> dict:
    _mount_work(req)
    if relay_fd is not None:
        _listen(req["listen"], relay_fd)
    cpu = CpuClock(cpu_fd, req["limits"]["cpu_s"]) if cpu_fd is not None else None
    # Made with the execution's uid as the real one (the effective stays 0): a pipe's pages count against its
    # creator's fs.pipe-user-pages-soft, and as this process's uid, shared by every execution, 20 executions that grew
    # their pipes to 1 MiB (F_SETPIPE_SZ) left the next ones pipes of 8 KiB.
    os.setresuid(req["uid"], -1, -1)
    try:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        test_r, test_w = os.pipe()
        alive_r, alive_w = os.pipe()  # held open by this process alone: the runner sees EOF once it is gone
        setup_r, setup_w = os.pipe()  # the runner's set-up errors; closed before the code runs
    finally:
        os.setresuid(0, -1, -1)
    req["rlimit_cpu"] = cpu.rlimit if cpu is not None else None
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            runner.run(req, stdin_fd, (out_w, err_w, test_w, alive_r, setup_w), cgroup_fds, seccomp)
        except BaseException as e:  # set-up failed before the code ran: say so on its stderr
            os.write(err_w, f"sandbox: runner set-up failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(71)
    pidfd = os.pidfd_open(pid)
    for fd in (out_w, err_w, test_w, alive_r, setup_w, *cgroup_fds) + ((stdin_fd,) if stdin_fd is not None else ()):
        os.close(fd)
    names = {out_r: "stdout", err_r: "stderr", test_r: "tests", setup_r: "setup"}
    streams, breach = _drain(pid, pidfd, names, req["limits"], start, cpu, oom, commands)
    # Unkilled, the pidfd said the whole namespace was gone; killed, it may not go at once (see REAP_S).
    reaped = breach is None or bool(select.select([pidfd], [], [], REAP_S)[0])
    _, status, usage = os.wait4(pid, 0 if reaped else os.WNOHANG)
    if not reaped:  # the usage of what was reaped so far is zero; the cgroup's CPU counter below has it all
        status = signal.SIGKILL
    # Closing a unix socket schedules the kernel's unix GC: a cycle of sockets the code left in flight holds its
    # /work and pipes, charged to the slot the next execution gets, until something on the host closes one.
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).close()  # 6 us
    # What the runner reaped is in its rusage; what it left to the namespace's end (orphans) only in the cgroup's.
    cpu_s = max(usage.ru_utime + usage.ru_stime, cpu.used() if cpu else 0.0)
    if breach is None and cpu is not None and cpu_s > cpu.budget:  # spent between the last read and the end
        breach, cpu.detected = "cpu", cpu_s
    verdict = _verdict(req["limits"], streams, breach, status, usage, time.monotonic() - start, cpu_s)
    if breach == "cpu" and cpu is not None:
        verdict["cpu_detected_s"] = cpu.detected
    if not reaped:
        verdict["unreaped"] = True
    return verdict


def _drain(
    pid: int,
    pidfd: int,
    names: dict[int, str],
    limits: dict,
    start: float,
    cpu: CpuClock | None = None,
    oom: OomWatch | None = None,
    commands: Commands | None = None,
) -> tuple[dict, str | None]:
    """Read the runner's pipes until it has exited and they are drained, or until the wall clock, the output cap,
    the CPU budget of all its processes or the memory limit (``oom``, see ``Cgroups.oom_event``) is hit (then kill
    it: PID 1 of its namespace, it takes every descendant with it)."""
    bufs = {name: bytearray() for name in names.values()}
    cap, total = limits["output_bytes"], 0
    deadline = start + limits["wall_s"]
    poller = select.poll()
    oom_fd = oom.fd if oom is not None else None
    for fd in (*names, pidfd, *([oom_fd] if oom_fd is not None else [])):
        poller.register(fd, select.POLLIN)
    open_fds, exited, breach = set(names), False, None
    next_cpu = cpu.next_read(start, 0.0) if cpu else math.inf
    while open_fds or not exited:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            breach = "wall"
            break
        if now >= next_cpu:
            used = cpu.used()
            if commands is not None and (cpu.spent or used > cpu.budget) and commands.kill_all(pid):
                cpu.spend()  # its commands ran the budget out: they die, the program goes on
            if used > cpu.budget:
                breach, cpu.detected = "cpu", used
                break
            next_cpu = cpu.next_read(now, used)
        for fd, _ in poller.poll(min(left, next_cpu - now) * 1000):
            if fd == oom_fd:
                if oom.breached(commands, pid):
                    breach = "memory"
                    break
                continue
            if fd == pidfd:
                exited = True  # the whole PID namespace is gone: what is left in the pipes ends in EOF
                poller.unregister(pidfd)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[names[fd]] += chunk
            total += len(chunk)
        if breach is None and total > cap:
            breach = "output"
        if breach:
            break
    if breach:  # its child, not reaped before wait4: the pid is still its own, and the pidfd says so anyway
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    return {k: bytes(v) for k, v in bufs.items()}, breach


def _verdict(limits: dict, streams: dict, breach: str | None, status: int, usage, wall: float, cpu: float) -> dict:
    if streams["setup"]:  # before the code ran: the sandbox's failure, whatever else the pipes hold
        return {
            "status": "sandbox_error",
            "reason": "runner set-up failed: " + streams["setup"].decode(errors="replace"),
        }
    stderr = streams["stderr"].decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    cap = limits["output_bytes"]
    # The test channel's end first (the harness writes its lines last), then stdout, the graded stream, then stderr.
    budget = cap + cap // 2
    test_lines, used = _fit(streams["tests"].decode(errors="replace"), budget, tail=True)
    stdout, more = _fit(streams["stdout"][:cap].decode(errors="replace"), budget - used, tail=False)
    verdict = {
        "exit_code": code,
        "stdout": stdout,
        "stderr": _fit(stderr[-cap:], budget - used - more, tail=True)[0],
        "test_lines": test_lines,
        "wall_s": wall,
        "cpu_s": cpu,
        "max_rss_mb": usage.ru_maxrss / 1024,
    }
    verdict.update(_classify(limits, breach, code, cpu, stderr, streams["tests"]))
    return verdict


def _fit(text: str, budget: int, tail: bool) -> tuple[str, int]:
    """``text`` (its end when ``tail``) cut to at most ``budget`` bytes of JSON, and the bytes it takes.

    JSON writes a control character in 6 bytes, and an invalid byte (U+FFFD, 3 bytes in UTF-8) took 6 too when the
    verdict was ASCII-escaped: a megabyte of such output was a 6 MB verdict, which the pool parses on the loop every
    neighbour waits on (14 ms) and a node serialises again (42 ms). Output within the limit whose escapes add at most
    half its size (ordinary text: a newline adds one byte to its line) is never cut."""
    size = _json_size(text)
    keep = len(text) * budget // max(size, 1)  # as dense as the whole text
    while size > budget:  # twice at most: dropping n more characters drops at least n bytes
        text = text[len(text) - keep :] if tail else text[:keep]
        size = _json_size(text)
        keep = max(0, keep - (size - budget))
    return text, size


def _json_size(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


def _classify(limits: dict, breach: str | None, code: int, cpu: float, stderr: str, tests: bytes) -> dict:
    if breach == "wall":
        return {"status": "timeout", "reason": f"wall time limit of {limits['wall_s']} s exceeded"}
    if breach == "cpu":
        return {"status": "timeout", "reason": f"CPU time limit of {limits['cpu_s']} s exceeded (all its processes)"}
    if breach == "memory":
        return {"status": "memory_limit", "reason": f"memory limit of {limits['memory_mb']} MB exceeded"}
    if breach == "output":
        return {"status": "output_limit", "reason": f"stdout+stderr over {limits['output_bytes']} bytes"}
    # RLIMIT_CPU ends it with SIGXCPU, or SIGKILL at the hard limit (PID 1 of a namespace ignores SIGXCPU). The
    # kernel counts the limit in its own ticks: on a loaded host the rusage of a process it killed at 1 s read 0.89 s.
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= 0.8 * limits["cpu_s"]):
        return {"status": "timeout", "reason": f"CPU time limit of {limits['cpu_s']} s exceeded"}
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if "MemoryError" in last or b'"error": "MemoryError' in tests:
        return {"status": "memory_limit", "reason": f"memory limit of {limits['memory_mb']} MB exceeded"}
    if "Resource temporarily unavailable" in last and ("fork" in stderr or "BlockingIOError" in last):
        return {"status": "error", "reason": f"process limit of {limits['processes']} reached ({last[:200]})"}
    if code < 0:
        return {"status": "error", "reason": f"killed by signal {_signal_name(-code)}"}
    if code != 0:
        return {"status": "error", "reason": last[:300] or f"exit code {code}"}
    return {"status": "ok", "reason": ""}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return str(number)
