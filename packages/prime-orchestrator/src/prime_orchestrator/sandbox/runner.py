"""The runner: PID 1 of an execution's namespaces, which becomes the untrusted code.

In order, each step before the code runs and none undoable by it: leave the pool's process group, join the slot's
cgroups (descriptors the pool opened), set the standard descriptors and close every other one, apply the rlimits,
drop to the execution's uid (no capabilities), subscribe to a fresh session keyring, set ``no_new_privs`` and the
parent-death signal, install the system-call filter (:mod:`seccomp`, compiled on the host), then run the code:
Python in this warm interpreter (no start-up), anything else through ``execve``, with an environment the request
spells out entirely.

Stdlib only (imported by the zygote, see :mod:`zygote`).
"""

from __future__ import annotations

import fcntl
import math
import os
import resource
import select
import signal

if __package__:
    from prime_orchestrator.sandbox import _linux as lx
    from prime_orchestrator.sandbox import pyharness
else:  # inside the zygote (see zygote.py)
    import _linux as lx
    import pyharness

TEST_FD = 3
SETUP_FD = 5  # after the test channel (3) and the supervisor's liveness pipe (4)
# Signals queued and POSIX timers held by the execution's uid at once (a program needs a few). Inherited from the pool,
# it was the host's whole count (96,365 here), which the zygote's user namespace shares (see zygotes.sigpending_cap).
SIGPENDING_PER_EXECUTION = 64
# Memory the code may lock. Inherited, it was the pool's: unlimited on GPU hosts (NCCL and InfiniBand want it), and
# the code locked the host's page cache of bound files (/usr), which no memory cgroup of the execution counts.
MEMLOCK_BYTES = 64 << 10


def _at_most_hard(rlim: int, value: int) -> int:
    hard = resource.getrlimit(rlim)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def _limit_and_drop(uid: int, limits: dict, rlimit_cpu: int | None = None) -> None:
    for rlim, value in (
        (resource.RLIMIT_AS, limits["memory_mb"] << 20),
        # the limit itself, or a backstop above it where the supervisor's clock stops the total (CpuClock.rlimit)
        (resource.RLIMIT_CPU, rlimit_cpu or max(1, math.ceil(limits["cpu_s"]))),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["disk_mb"] << 20),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        # 1, not 0: a core_pattern that pipes to a helper (apport, systemd-coredump) ignores RLIMIT_CORE, except
        # that 1 aborts the dump; so a crash never starts a host helper as root, nor writes a core file.
        (resource.RLIMIT_CORE, 1),
        (resource.RLIMIT_MSGQUEUE, 0),
        # At most the hard limit the pool's host set (raising it would fail the set-up of every execution).
        (resource.RLIMIT_SIGPENDING, _at_most_hard(resource.RLIMIT_SIGPENDING, SIGPENDING_PER_EXECUTION)),
        (resource.RLIMIT_MEMLOCK, _at_most_hard(resource.RLIMIT_MEMLOCK, MEMLOCK_BYTES)),
        # Otherwise inherited from the pool's host: a real-time priority or a negative nice value would let the
        # code take the CPUs from its neighbours, the supervisors and the trainer on the same machine.
        (resource.RLIMIT_RTPRIO, 0),
        (resource.RLIMIT_NICE, 0),
    ):
        resource.setrlimit(rlim, (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    # After the uid change, so the keyring belongs to (and is charged to) the execution's uid.
    lx.join_new_session_keyring()
    # The uid change left it at the host's fs.suid_dumpable (2 where apport is installed): no core of the code's
    # memory for anyone, whatever the host's core_pattern (an argv program is dumpable again after execve: the
    # RLIMIT_CORE of 1 above covers it).
    lx.prctl(lx.PR_SET_DUMPABLE, 0)
    lx.prctl(lx.PR_SET_NO_NEW_PRIVS, 1)
    # After the uid change, which clears it: the execution dies with its supervisor (and so with the pool).
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)


def run(req: dict, stdin_fd: int | None, pipes: tuple[int, ...], cgroup_fds: list[int], seccomp) -> None:
    """Set up, then run the code (never returns). A set-up failure goes to the set-up pipe, which the code never
    holds: the supervisor reports it as the sandbox's error, and the code cannot forge one."""
    out_w, err_w, test_w, alive_r, setup_w = pipes
    setup = [fcntl.fcntl(setup_w, fcntl.F_DUPFD_CLOEXEC, 64)]
    try:
        _set_up(req, stdin_fd, (out_w, err_w, test_w, alive_r), setup, cgroup_fds, seccomp)
    except BaseException as e:
        os.write(setup[0], f"{type(e).__name__}: {e}"[:500].encode())
        os._exit(71)
    env = {"PATH": req["path"], "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8", "USER": "sandbox"}
    env.update(req.get("env") or {})
    if req.get("argv"):
        os.close(TEST_FD)
        try:
            os.execvpe(req["argv"][0], req["argv"], env)  # the set-up pipe is close-on-exec
        except OSError as e:
            os.write(2, f"sandbox: cannot execute {req['argv'][0]!r}: {e.strerror}\n".encode())
            os._exit(127)
    os.close(SETUP_FD)
    os.environ.clear()
    os.environ.update(env)
    pyharness.run(req.get("code", ""), req.get("tests") or [], TEST_FD)


def _set_up(req: dict, stdin_fd, pipes: tuple[int, ...], setup: list[int], cgroup_fds: list[int], seccomp) -> None:
    out_w, err_w, test_w, alive_r = pipes
    # Dies with the supervisor from here on (the pool kills a supervisor to stop an execution): before the cgroup
    # join, so a runner whose supervisor is gone never enters a slot the pool may have lent again.
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(70)
    # A process group of its own: kill(0) reaches the caller's group wherever its members are, and the pool's (the
    # zygote's) is outside this PID namespace; SIGCONT from inside resumed a stopped host process of that group.
    os.setpgid(0, 0)
    for fd in cgroup_fds:  # as the zygote's root still; the pool opened them, so the kernel lets us in
        os.write(fd, b"0")
    alive_r = fcntl.fcntl(alive_r, fcntl.F_DUPFD, 64)  # above the numbers the dup2 calls below overwrite
    if stdin_fd is None:
        stdin_fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(test_w, TEST_FD)
    alive_r = os.dup2(alive_r, TEST_FD + 1)
    setup[0] = os.dup2(setup[0], SETUP_FD, inheritable=False)
    os.closerange(SETUP_FD + 1, 1 << 16)
    os.chdir("/work")
    _limit_and_drop(req["uid"], req["limits"], req.get("rlimit_cpu"))
    # A supervisor that died before the prctl sends no signal; as PID 1 of its namespace the runner cannot
    # ask getppid(), so it looks at the pipe only the supervisor holds open.
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(70)
    os.close(alive_r)
    if seccomp is not None:
        seccomp.install()
