"""Memory and process cgroups per execution slot, on the host side: what RLIMITs cannot bound.

RLIMIT_AS bounds each process's address space, but not what an execution holds outside it: pages of files in its
tmpfs, pipe and socket buffers, several processes at once; RLIMIT_CPU bounds each process's CPU time, not their sum.
A cgroup counts all of it. The pool makes one cgroup per execution slot (memory controller, pids where it is given,
and v1's cpuacct where it is mounted; v2 counts CPU time in every cgroup; the cpu controller where it is mounted or delegated,
which gives each execution one CPU weight however many processes it runs) under its own cgroup, itself under a
``prime-sandbox`` cgroup that every pool of the host running in the same cgroup shares (:data:`SHARED`: the task cap
bounds them all together, and on a CPU hierarchy all the pools weigh as one group against the host), where the host
lets it:

- cgroup v2, when the pool's cgroup delegates ``memory`` (and ``pids``) to its children (``cgroup.subtree_control``,
  as systemd's ``Delegate=yes``; :mod:`delegate`), or the pool runs in the root cgroup;
- cgroup v1, when the ``memory`` hierarchy (and ``pids``) is mounted writable (root on a v1 host).

Otherwise :meth:`Cgroups.detect` says why, and the pool logs that these limits are not enforced. Where ``pids`` is
not there (a job system's cgroup given ``memory`` only; :attr:`Cgroups.no_tasks` says why), the slots' cgroups are
memory ones and the rest holds: an execution's tasks are then bounded by RLIMIT_NPROC of its own uid alone, and
those of every pool together by nothing (the pool says so). A runner joins its
slot's cgroups by writing ``0`` to the ``tasks`` (v1) or ``cgroup.procs`` (v2) files the pool opened for it (the
kernel checks the opener's credentials), before it drops its privileges; nothing of the cgroup filesystem is
visible inside.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import time
from pathlib import Path

from prime_orchestrator.sandbox.delegate import delegate
from prime_orchestrator.sandbox.hierarchies import mounts, own_cgroups, path_of
from prime_orchestrator.sandbox.memcap import limit_memory, memory_cap, memory_files, task_cap
from prime_orchestrator.sandbox.stale import holds_processes

MIB = 1 << 20
CLOSE_WAIT_S = 2.0
"""How long :meth:`Cgroups.close` waits for the pool's processes to leave its cgroups: a killed zygote's supervisors
die of PDEATHSIG after it, and a process in ``exit()`` still holds its cgroup (rmdir: EBUSY) after its pipes closed."""
FDS_PER_KEY = 9
"""Descriptors a slot's (or workspace's) cgroups keep open once used: ``tasks``/``cgroup.procs`` of each controller
(v1: memory, pids, cpuacct, cpu, blkio), v1's memory peak and OOM eventfd, the CPU usage counter and the memory usage
(see :meth:`left_over`).
Slots are reused first in, first out, so every slot's are open after a while."""


def lift_open_files(need: int) -> str | None:
    """Raise this process's soft RLIMIT_NOFILE to ``need``, up to its hard limit (as servers do at start: the soft
    limit is often 1024); why it stays below ``need``, or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(hard, need)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return None if target >= need else f"open files are limited to {hard} (RLIMIT_NOFILE's hard limit)"


SHARED = "prime-sandbox"
"""The cgroup, beside this process's own in each hierarchy, that every pool of the host running there makes its own
under (created by the first, never removed while a pool is in it): :func:`task_cap` bounds all of them together."""
CREATE_TRIES = 50  # a pool closing may remove the shared cgroup between another's mkdir of it and of its own (5 ran out in one CI run under load, with a fifth hierarchy: blkio)
# What a mkdir in (or of) a shared cgroup a pool is removing answers: gone (ENOENT), going (ENODEV), or there for
# mkdir and gone for the check after it (EEXIST): 2 of 450 starts raced with closes in three threads failed so.
RACES = (errno.ENOENT, errno.ENODEV, errno.EEXIST)


def _make_dir(path: Path, version: int, enable: str = "+memory +pids") -> None:
    """Make a pool's cgroup ``path`` and, where it is not yet, the shared one above it with the host-wide task cap
    (on the pids hierarchy's, or v2's: the slots' pids cgroups are below it, so it bounds every pool's together);
    v2: ``enable`` the controllers for the children of both (``+memory`` alone where ``pids`` is not delegated).
    Every pool writes the same cap and the same controllers, so which of two starting pools makes the shared cgroup
    does not matter; a closing pool removes it only when empty (the kernel refuses otherwise), and a pool that finds
    it gone, or going, between its two mkdirs makes it again."""
    shared = path.parent
    for attempt in range(CREATE_TRIES):
        try:
            shared.mkdir(exist_ok=True)
            if (shared / "pids.max").exists() and (cap := task_cap()) is not None:
                (shared / "pids.max").write_text(str(cap))
            if memory_files(shared) and (memory := memory_cap()) is not None:
                with contextlib.suppress(OSError):  # EBUSY: the pools already hold more (the cap is the same for all)
                    limit_memory(shared, memory)
            if version == 2:
                (shared / "cgroup.subtree_control").write_text(enable)
                for optional in ("+cpu", "+io"):  # where delegated (see place_zygote, diskio)
                    with contextlib.suppress(OSError):
                        (shared / "cgroup.subtree_control").write_text(optional)
            path.mkdir(exist_ok=True)
            if version == 2:
                (path / "cgroup.subtree_control").write_text(enable)
            return
        except OSError as e:  # removed, or being removed, by a pool closing: make it again
            if e.errno not in RACES or attempt == CREATE_TRIES - 1:
                raise
            time.sleep(0.001 * attempt)  # let the closing pool finish its rmdirs (at most 1.2 s over all tries)


def _resettable_peak(cgroup: Path) -> int | None:
    """A descriptor of v2 ``memory.peak`` that a write resets (Linux 6.12+: each open file keeps a peak of its own
    since its last write), or None (older kernels refuse the write: no per-execution peak there)."""
    try:
        fd = os.open(cgroup / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.write(fd, b"0")
    except OSError:
        os.close(fd)
        return None
    return fd


class Cgroups:
    """Memory(+pids) cgroups under the pool's own, one per key (``s<slot>`` for an execution slot, ``w<uid>`` for a
    workspace, whose files stay charged to it), created on first use."""

    def __init__(
        self, version: int, parents: dict[str, Path], cpu_parent: Path | None = None, no_tasks: str = ""
    ) -> None:
        self.version = version
        self.parents = parents  # controller -> this pool's cgroup directory ("" for v2)
        # This pool's directory in the CPU controller's hierarchy, where its zygotes run (see place_zygote)
        self.cpu_parent = cpu_parent
        self.no_tasks = no_tasks
        """Why there is no pids controller ('' where there is): no pids.max per slot nor the host-wide task cap."""
        self._limits: dict[str, tuple[int, int]] = {}
        self.total_mb: int | None = None  # see limit_total
        self._ooms: dict[str, int] = {}
        # Per key, kept open: its cgroup.procs descriptors (sent to each runner) and its peak counter (v1). Opening
        # cgroup files is the costly part (about 0.1 ms each), and a slot serves one execution after another.
        self._procs: dict[str, list[int]] = {}
        self._peak: dict[str, int] = {}
        self._cpu: dict[str, int] = {}
        self._usage: dict[str, int] = {}
        self._members: dict[str, int] = {}
        self._oom_events: dict[str, int | None] = {}

    @property
    def counts_cpu(self) -> bool:
        """Whether :meth:`cpu_fd` gives a key's CPU time: always on v2 (``cpu.stat`` is a core file), on v1 with a
        ``cpuacct`` hierarchy."""
        return self.version == 2 or "cpuacct" in self.parents

    @classmethod
    def detect(cls, name: str, io: bool = True) -> tuple[Cgroups | None, str]:
        """The pool's cgroups (named ``name``; with ``io``, v1's blkio one where mounted, see :meth:`io_dir`), or None
        and the reason they cannot be used here."""
        try:
            own, mounted = own_cgroups(), mounts()
        except OSError as e:
            return None, f"cannot read this process's cgroups ({e})"
        if (memory := path_of("memory", mounted, own)) is not None:
            v1, no_tasks = {"memory": memory}, "no cgroup v1 pids hierarchy is mounted"
            if (pids := path_of("pids", mounted, own)) is not None:
                v1["pids"], no_tasks = pids, ""
            # cpuacct when mounted: the CPU time of an execution's processes together (see cpu_fd)
            cpu = {"cpuacct": path} if (path := path_of("cpuacct", mounted, own)) else {}
            # cpu: each execution's weight (see place_zygote); mounted with cpuacct, the cpuacct join moves it too
            if (weight := path_of("cpu", mounted, own)) is not None and weight != cpu.get("cpuacct"):
                cpu["cpu"] = weight
            if io and (blkio := path_of("blkio", mounted, own)):  # each execution's disk reads (see diskio)
                cpu["blkio"] = blkio
            parents = {c: p / SHARED / name for c, p in {**v1, **cpu}.items()}
            return cls._make(1, parents, weight and weight / SHARED / name, no_tasks)
        v2 = path_of("", mounted, own)
        if v2 is None:
            return None, "no cgroup v2 mount and no writable cgroup v1 memory hierarchy"
        try:
            delegated = set((v2 / "cgroup.subtree_control").read_text().split())
            if not {"memory", "pids"} <= delegated and v2 == Path(mounted[""][1]):  # the root cgroup may enable them
                (v2 / "cgroup.subtree_control").write_text("+memory")
                with contextlib.suppress(OSError):  # where the host has it on cgroup v2
                    (v2 / "cgroup.subtree_control").write_text("+pids")
                delegated = set((v2 / "cgroup.subtree_control").read_text().split())
            if not {"memory", "pids"} <= delegated:
                if why := delegate(v2):
                    return None, why
                delegated = set((v2 / "cgroup.subtree_control").read_text().split())
        except OSError as e:
            return None, f"{v2} does not delegate memory ({e.strerror})"
        no_tasks = "" if "pids" in delegated else f"the pids controller is not enabled below {v2}"
        return cls._make(2, {"": v2 / SHARED / name}, no_tasks=no_tasks)

    @classmethod
    def _make(
        cls, version: int, parents: dict[str, Path], cpu_parent: Path | None = None, no_tasks: str = ""
    ) -> tuple[Cgroups | None, str]:
        """The pool's cgroups at ``parents`` (controller -> ``<own cgroup>/<SHARED>/<pool>``), each made under the
        shared cgroup of every pool of the host (made here where it is not yet, with the host-wide task cap)."""
        # Without them the tasks, CPU total or weight, or disk reads go free (the pool says which)
        for optional in ("pids", "cpuacct", "cpu", "blkio"):
            if optional in parents:
                try:
                    _make_dir(parents[optional], 1)
                except OSError as e:
                    if optional == "pids":
                        no_tasks = f"cannot create {parents[optional]} ({e.strerror})"
                    parents = {c: p for c, p in parents.items() if c != optional}
        if version == 1 and cpu_parent not in parents.values():  # its hierarchy (cpu, or cpu,cpuacct) is not usable
            cpu_parent = None
        try:
            for path in parents.values():
                _make_dir(path, version, "+memory" if no_tasks else "+memory +pids")
            if version == 2:
                with contextlib.suppress(OSError):  # where the host delegates it (see place_zygote)
                    (parents[""] / "cgroup.subtree_control").write_text("+cpu")
                    cpu_parent = parents[""]
                with contextlib.suppress(OSError):  # where the host delegates it (see io_dir)
                    (parents[""] / "cgroup.subtree_control").write_text("+io")
        except OSError as e:
            cls(version, parents).close()
            return None, f"cannot create {next(iter(parents.values()))} ({e.strerror})"
        return cls(version, parents, cpu_parent, no_tasks), ""

    def limit_total(self, mb: int | None) -> None:
        """Bound the memory of this pool's executions together to ``mb`` (``SandboxPoolConfig.total_memory_mb``; None:
        only the host-wide :func:`memory_cap`). Past it, the kernel's OOM killer of this pool's cgroup (left on here,
        off in each slot's: see :meth:`oom_event`) kills the largest process of the pool's executions, and every
        slot's OOM eventfd fires (v1 tells the whole subtree): a supervisor ends its execution only where its own
        slot is at its own limit (:meth:`oom_usage`); the others go on. Nothing waits at the limit."""
        self.total_mb = mb
        if mb is not None:
            limit_memory(self.parents["memory" if self.version == 1 else ""], mb * MIB)

    def total_reason(self, key: str) -> str | None:
        """Why an execution of ``key`` that ended as ``memory_limit`` did: the pool's total (one line naming the
        field) when the slot stayed under its own limit, else None (its own ``memory_mb``)."""
        peak, own = self.peak_mb(key), self._limits.get(key, (0, 0))[0] / MIB
        if self.total_mb is None or peak is None or peak >= own - 1:
            return None
        return f"the pool's memory limit of {self.total_mb} MB for all its executions together (total_memory_mb)"

    def place_zygote(self, pid: int) -> str:
        """Move a zygote, and so every supervisor it forks, into this pool's ``zygotes`` CPU cgroup (its executions
        then join their slot's, beside it); '' or why it stays where it is. In the root CPU cgroup the kernel's
        autogroups give each session the weight of a whole host session: an execution whose 8 processes each called
        ``setsid`` took 7.8 times the CPU of a host process (the trainer's, the inference server's) on the same core
        (1.0 without ``setsid``). Autogroups apply in the root CPU cgroup only."""
        if self.cpu_parent is None:
            return "no cpu cgroup hierarchy"  # the pool lists it as not enforced
        d = self.cpu_parent / "zygotes"
        try:
            d.mkdir(parents=True, exist_ok=True)
            self._write(d / "cgroup.procs", str(pid))
        except OSError as e:
            return f"cannot move a zygote into {d} ({e.strerror})"
        return ""

    def io_dir(self) -> Path | None:
        """This pool's cgroup whose children throttle disk reads (see diskio): v1's blkio one, v2's own where its
        children have the io controller; None where there is none."""
        if self.version == 1:
            return self.parents.get("blkio")
        with contextlib.suppress(OSError):
            if "io" in (self.parents[""] / "cgroup.subtree_control").read_text().split():
                return self.parents[""]
        return None

    def dirs(self) -> set[Path]:
        """This pool's cgroup directories, in every hierarchy (the CPU one's too)."""
        return {*self.parents.values(), *([self.cpu_parent] if self.cpu_parent is not None else [])}

    def _dirs(self, key: str) -> dict[str, Path]:
        return {c: p / key for c, p in self.parents.items()}

    def _write(self, path: Path, value: str) -> None:
        with open(path, "w") as f:
            f.write(value)

    def _set_limits(self, key: str, memory: int, pids: int) -> None:
        dirs = self._dirs(key)
        if self._limits.get(key) is None:
            for d in dirs.values():
                d.mkdir(exist_ok=True)
        if self.version == 1:
            mem = dirs["memory"]
            old = self._limits.get(key, (1 << 62, 0))[0]  # a new cgroup starts unlimited
            files = ["memory.limit_in_bytes"]
            if (mem / "memory.memsw.limit_in_bytes").exists():  # swap accounting: no swapping past the limit either
                files.append("memory.memsw.limit_in_bytes")
            for name in files if memory < old else reversed(files):  # memsw may never be below the limit
                self._write(mem / name, str(memory))
        else:
            d = dirs[""]
            self._write(d / "memory.max", str(memory))
            with contextlib.suppress(OSError):  # no swap accounting on this host: nothing to bound
                self._write(d / "memory.swap.max", "0")
            if key not in self._limits:
                with contextlib.suppress(OSError):  # Linux < 4.19: each OOM kill is reported (and the pool says so)
                    self._write(d / "memory.oom.group", "1")
        if not self.no_tasks:  # else RLIMIT_NPROC of the key's own uid alone bounds its tasks (see runner)
            self._write(dirs["pids" if self.version == 1 else ""] / "pids.max", str(pids))
        self._limits[key] = (memory, pids)

    def enter(self, key: str, memory_mb: int, processes: int) -> list[int]:
        """Set the key's limits and reset its peak; the ``cgroup.procs`` descriptors a runner writes ``0`` to
        (kept open here: the caller only sends them)."""
        memory = memory_mb * MIB
        if self._limits.get(key) != (memory, processes):
            self._set_limits(key, memory, processes)
        if key not in self._procs:
            dirs = self._dirs(key)
            # v1: the runner, single-threaded, moves itself through ``tasks``: migrating the current thread alone
            # skips the global threadgroup lock that ``cgroup.procs`` takes (an RCU grace period when it is cold:
            # a p99 of 3-11 ms per join on the loaded 2-core VM, against 0.2-0.8 ms).
            name = "tasks" if self.version == 1 else "cgroup.procs"
            self._procs[key] = [os.open(d / name, os.O_WRONLY | os.O_CLOEXEC) for d in dirs.values()]
            if self.version == 1:
                self._peak[key] = os.open(dirs["memory"] / "memory.max_usage_in_bytes", os.O_RDWR | os.O_CLOEXEC)
            elif (peak := _resettable_peak(dirs[""])) is not None:
                self._peak[key] = peak
        if key in self._peak:
            os.write(self._peak[key], b"0")
        return self._procs[key]

    def oom_event(self, key: str) -> int | None:
        """v1: an eventfd that becomes readable when a process of the key reaches its memory limit, for the
        execution's supervisor, which then kills the execution itself (emptied here of an earlier execution's count);
        None elsewhere. The kernel's OOM killer is off in the key's memory cgroup once the eventfd is registered, so
        a process at the limit waits (killable) instead of being killed: every kill printed a full report into the
        host's kernel log, and an execution re-forking children that each allocate printed 955 lines in 5 s, for its
        whole wall limit, in every slot at once. Allocations outside a page fault (a tmpfs write, a pipe) fail with
        ``ENOMEM`` instead. v2 has no such switch: ``memory.oom.group`` kills the whole execution at its first OOM
        (one report, see :meth:`_set_limits`)."""
        if self.version != 1:
            return None
        if key not in self._oom_events:
            self._oom_events[key] = self._watch_oom(self._dirs(key)["memory"])
        fd = self._oom_events[key]
        # A workspace's executions may run together, sharing its cgroup and this eventfd: while one runs, the count
        # is its own (an execution entering emptied it before its supervisor saw it, and that one's processes
        # waited at the limit until its wall limit). Each supervisor seeing it ends its own: the workspace's memory
        # is theirs together, as v2's memory.oom.group kills all of them.
        if fd is not None and not (key.startswith("w") and self.pids(key)):
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(fd)
        return fd

    def watches_oom(self, key: str) -> bool:
        """Whether :meth:`oom_event` gave the key an eventfd (without emptying it again)."""
        return self._oom_events.get(key) is not None

    def oom_usage(self, key: str) -> int | None:
        """v1, with :meth:`oom_event`: the key's ``memory.usage_in_bytes`` (kept open), for the supervisor to tell its
        own limit from the pool's (:meth:`limit_total`): v1 signals an OOM to every eventfd of the cgroup's subtree,
        and one execution past the pool's limit ended all 4 running beside it (under their own limits)."""
        if not self.watches_oom(key):
            return None
        self.usage(key)
        return self._usage[key]

    def oom_limit(self, key: str) -> int | None:
        """The key's memory limit in bytes where :meth:`oom_usage` gives its usage, else None."""
        return self._limits[key][0] if self.watches_oom(key) and key in self._limits else None

    def _watch_oom(self, mem: Path) -> int | None:
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            ctl = os.open(mem / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._write(mem / "cgroup.event_control", f"{efd} {ctl}")
            finally:
                os.close(ctl)
            self._write(mem / "memory.oom_control", "1")  # only once someone is told: a waiting task needs a killer
        except OSError:
            os.close(efd)
            return None
        return efd

    def usage(self, key: str) -> int:
        """The key's memory charge in bytes (v1 ``memory.usage_in_bytes``, v2 ``memory.current``; kept open)."""
        d = self._dirs(key)
        path = d["memory"] / "memory.usage_in_bytes" if self.version == 1 else d[""] / "memory.current"
        return int(os.pread(self._kept(self._usage, key, path), 32, 0))

    def left_over(self, key: str, small: int) -> int:
        """Bytes charged to the key that are not the page cache of files read (which the kernel reclaims when the next
        execution needs the memory): what executions left behind that the next one would have to live without. One
        read when the whole charge is at most ``small`` (then it is returned as it is); an empty slot holds 0.2 MiB
        on the test VM."""
        usage = self.usage(key)
        if usage <= small:
            return usage
        d = self._dirs(key)
        prefix = "total_" if self.version == 1 else ""
        try:
            text = (d["memory"] / "memory.stat" if self.version == 1 else d[""] / "memory.stat").read_text()
        except OSError:
            return usage
        stat = dict(line.split() for line in text.splitlines())
        return max(0, usage - int(stat.get(prefix + "active_file", 0)) - int(stat.get(prefix + "inactive_file", 0)))

    def reclaim(self, key: str, nbytes: int) -> None:
        """Have the kernel reclaim the key's memory now (v2 ``memory.reclaim`` of ``nbytes``, v1
        ``memory.force_empty``; a blocking call of tens of ms): what it frees only under pressure otherwise, such as
        the negative dentries of lookups (20 MiB for 100,000 names), which held the slot for :data:`SETTLE_S` each
        time. Nothing is said when the kernel has no such file or reclaims less."""
        d = self._dirs(key)
        path, value = (d["memory"] / "memory.force_empty", "0") if self.version == 1 else (d[""] / "memory.reclaim", "")
        with contextlib.suppress(OSError):  # EAGAIN: less reclaimed than asked; ENOENT: older kernel
            self._write(path, value or str(nbytes))

    def cpu_fd(self, key: str) -> int | None:
        """A read-only descriptor of the key's CPU time counter (kept open here), for the execution's supervisor:
        v1 ``cpuacct.usage`` (nanoseconds), v2 ``cpu.stat`` (``usage_usec``); None where there is none. RLIMIT_CPU
        bounds each process, not their sum: a chain of children, each under it, ran a 1 s execution for 6 s."""
        if not self.counts_cpu:
            return None
        d = self._dirs(key)
        return self._kept(self._cpu, key, d["cpuacct"] / "cpuacct.usage" if self.version == 1 else d[""] / "cpu.stat")

    def commands_fds(self, key: str) -> list[int]:
        """For a harness program's supervisor (``supervisor.Commands``): read-only descriptors of the key's
        ``cgroup.procs`` and of the host's ``/proc`` (kept with them; the runner closes both before the code runs)."""
        procs = self._dirs(key)["memory" if self.version == 1 else ""] / "cgroup.procs"
        return [self._kept(self._members, key, procs), self._kept(self._members, "/proc", Path("/proc"))]

    def _kept(self, store: dict[str, int], key: str, path: Path) -> int:
        if key not in store:
            store[key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return store[key]

    def _oom_count(self, key: str) -> int:
        d = self._dirs(key)
        path = d["memory"] / "memory.oom_control" if self.version == 1 else d[""] / "memory.events"
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed(self, key: str) -> bool:
        """Whether the memory limit killed a process of the key's cgroup since this was last asked (asked after
        an execution's init died of SIGKILL, which nothing inside can send it)."""
        count = self._oom_count(key)
        killed, self._ooms[key] = count > self._ooms.get(key, 0), count
        return killed

    def peak_mb(self, key: str) -> float | None:
        """The slot's peak memory since :meth:`enter` (v1; v2 from Linux 6.12, whose ``memory.peak`` a write resets
        for the descriptor that wrote it; None before)."""
        if key not in self._peak:
            return None
        try:
            return int(os.pread(self._peak[key], 32, 0)) / MIB
        except (OSError, ValueError):
            return None

    def pids(self, key: str) -> list[int]:
        """Host pids of the processes in the slot (each of its hierarchies lists them all: its memory cgroup alone
        where there is no pids one)."""
        found: set[int] = set()
        for d in self._dirs(key).values():
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def _close_fds(self, key: str) -> None:
        kept = (self._peak, self._cpu, self._usage, self._members)
        fds = [*self._procs.pop(key, []), *(d.pop(key) for d in kept if key in d)]
        for fd in [*fds, self._oom_events.pop(key, None)]:
            if fd is not None:
                os.close(fd)

    def remove(self, key: str) -> None:
        """Remove one key's cgroups (once nothing runs in them)."""
        self._limits.pop(key, None)
        self._close_fds(key)
        for d in self._dirs(key).values():
            with contextlib.suppress(OSError):
                d.rmdir()

    def close(self) -> None:
        """Remove the pool's cgroups once its processes are gone (the zygotes killed first; waited for up to
        :data:`CLOSE_WAIT_S`); those still holding a process stay, and a later pool's start sweeps them."""
        for key in {*self._procs, *self._cpu, *self._usage, *self._members, *self._oom_events}:
            self._close_fds(key)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while any(holds_processes(d) for d in self.dirs()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.cpu_parent is not None and self.cpu_parent not in self.parents.values():
            for d in (self.cpu_parent / "zygotes", self.cpu_parent, self.cpu_parent.parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
        for parent in self.parents.values():
            children = [p for p in parent.iterdir() if p.is_dir()] if parent.is_dir() else []
            for child in children:
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
            with contextlib.suppress(OSError):  # the last pool of the host removes the shared cgroup
                parent.parent.rmdir()
