"""One execution, forked from the zygote: the supervisor (trusted) and the runner (untrusted code).

The supervisor enters fresh mount, PID and IPC namespaces, mounts the execution's private tmpfs (or its
workspace) on ``/work`` and forks the runner, which becomes PID 1 of its PID namespace: when it ends, the
kernel kills every process it left behind, so nothing outlives an execution. The runner drops to the
execution's uid (no capabilities, ``no_new_privs``), applies the rlimits and runs the code: Python in this
warm interpreter (no start-up), anything else through ``execve``. The supervisor drains stdout, stderr and the
test channel under the output cap and the wall clock, kills on breach, and writes one JSON verdict to the
result pipe.

Stdlib only (imported by the zygote, see :mod:`zygote`).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import resource
import select
import signal
import time

if __package__:
    from prime_orchestrator.sandbox import _linux as lx
    from prime_orchestrator.sandbox import pyharness
else:  # inside the zygote (see zygote.py)
    import _linux as lx
    import pyharness

TEST_FD = 3


def supervise(req: dict, fds: list[int], ctl_fd: int, zygote_pid: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(ctl_fd)
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before the prctl: no signal will ever come
        os._exit(0)
    result_fd, stdin_fd = fds[0], (fds[1] if len(fds) > 1 else None)
    try:
        verdict = _execute(req, stdin_fd)
    except Exception as e:  # a verdict, never a silent EOF: the pool reports it as a sandbox error
        verdict = {"status": "sandbox_error", "reason": f"supervisor: {type(e).__name__}: {e}"}
    own = resource.getrusage(resource.RUSAGE_SELF)
    verdict["supervisor_cpu_s"] = own.ru_utime + own.ru_stime
    data = json.dumps(verdict).encode()
    while data:
        data = data[os.write(result_fd, data) :]
    os.close(result_fd)  # the verdict is complete now, not after this process's namespaces are torn down
    os._exit(0)


def _mount_work(req: dict) -> None:
    lx.unshare(lx.CLONE_NEWNS | lx.CLONE_NEWPID | lx.CLONE_NEWIPC)
    uid, limits = req["uid"], req["limits"]
    flags = lx.MS_NOSUID | lx.MS_NODEV
    if req.get("workspace"):
        lx.mount("/.ws/" + req["workspace"], "/work", None, lx.MS_BIND)
        lx.mount(None, "/work", None, lx.MS_BIND | lx.MS_REMOUNT | flags)
    else:
        opts = f"size={limits['disk_mb']}m,nr_inodes=4096,mode=0700,uid={uid},gid={uid}"
        lx.mount("tmpfs", "/work", "tmpfs", flags, opts)


def _execute(req: dict, stdin_fd: int | None) -> dict:
    _mount_work(req)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    test_r, test_w = os.pipe()
    alive_r, alive_w = os.pipe()  # held open by this process alone: the runner sees EOF once it is gone
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            _runner(req, stdin_fd, out_w, err_w, test_w, alive_r)
        except BaseException as e:  # set-up failed before the code ran: say so on its stderr
            os.write(err_w, f"sandbox: runner set-up failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(71)
    for fd in (out_w, err_w, test_w, alive_r) + ((stdin_fd,) if stdin_fd is not None else ()):
        os.close(fd)
    streams, breach = _drain(pid, {out_r: "stdout", err_r: "stderr", test_r: "tests"}, req["limits"], start)
    _, status, usage = os.wait4(pid, 0)
    return _verdict(req["limits"], streams, breach, status, usage, time.monotonic() - start)


def _drain(pid: int, names: dict[int, str], limits: dict, start: float) -> tuple[dict, str | None]:
    """Read the runner's pipes until they close, the output cap or the wall clock is hit (then kill it)."""
    bufs = {name: bytearray() for name in names.values()}
    cap, total = limits["output_bytes"], 0
    deadline = start + limits["wall_s"]
    poller = select.poll()
    for fd in names:
        poller.register(fd, select.POLLIN)
    open_fds, breach = set(names), None
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            breach = "wall"
            break
        for fd, _ in poller.poll(left * 1000):
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[names[fd]] += chunk
            total += len(chunk)
        if total > cap:
            breach = "output"
            break
    if breach:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the kernel takes every descendant with it
    return {k: bytes(v) for k, v in bufs.items()}, breach


def _verdict(limits: dict, streams: dict, breach: str | None, status: int, usage, wall: float) -> dict:
    cpu = usage.ru_utime + usage.ru_stime
    tests = []
    for line in streams["tests"].splitlines():
        try:
            tests.append(json.loads(line))
        except ValueError:
            continue  # the channel is writable by the code under test; junk is ignored, never trusted
    stderr = streams["stderr"].decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    verdict = {
        "exit_code": code,
        "stdout": streams["stdout"][: limits["output_bytes"]].decode(errors="replace"),
        "stderr": stderr[-limits["output_bytes"] :],
        "tests": tests,
        "wall_s": wall,
        "cpu_s": cpu,
        "max_rss_mb": usage.ru_maxrss / 1024,
    }
    verdict.update(_classify(limits, breach, code, cpu, stderr, tests))
    return verdict


def _classify(limits: dict, breach: str | None, code: int, cpu: float, stderr: str, tests: list) -> dict:
    if breach == "wall":
        return {"status": "timeout", "reason": f"wall time limit of {limits['wall_s']} s exceeded"}
    if breach == "output":
        return {"status": "output_limit", "reason": f"stdout+stderr over {limits['output_bytes']} bytes"}
    # RLIMIT_CPU ends it with SIGXCPU, or SIGKILL at the hard limit (PID 1 of a namespace ignores SIGXCPU).
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits["cpu_s"] - 0.1):
        return {"status": "timeout", "reason": f"CPU time limit of {limits['cpu_s']} s exceeded"}
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if "MemoryError" in last or any("MemoryError" in str(t.get("error", "")) for t in tests):
        return {"status": "memory_limit", "reason": f"memory limit of {limits['memory_mb']} MB exceeded"}
    if "Resource temporarily unavailable" in last and ("fork" in stderr or "BlockingIOError" in last):
        return {"status": "error", "reason": f"process limit of {limits['processes']} reached ({last[:200]})"}
    if code < 0:
        return {"status": "error", "reason": f"killed by signal {signal.Signals(-code).name}"}
    if code != 0:
        return {"status": "error", "reason": last[:300] or f"exit code {code}"}
    return {"status": "ok", "reason": ""}


def _limit_and_drop(uid: int, limits: dict, alive_r: int) -> None:
    mem = limits["memory_mb"] << 20
    for rlim, value in (
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_CPU, max(1, math.ceil(limits["cpu_s"]))),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["disk_mb"] << 20),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(rlim, (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    lx.prctl(lx.PR_SET_NO_NEW_PRIVS, 1)
    # After the uid change, which clears it: the execution dies with its supervisor (and so with the pool).
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
    # A supervisor that died before the prctl sends no signal; as PID 1 of its namespace the runner cannot
    # ask getppid(), so it looks at the pipe only the supervisor holds open.
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(70)
    os.close(alive_r)


def _runner(req: dict, stdin_fd: int | None, out_w: int, err_w: int, test_w: int, alive_r: int) -> None:
    alive_r = fcntl.fcntl(alive_r, fcntl.F_DUPFD, 64)  # above the numbers the dup2 calls below overwrite
    if stdin_fd is None:
        stdin_fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(test_w, TEST_FD)
    alive_r = os.dup2(alive_r, TEST_FD + 1)
    os.closerange(TEST_FD + 2, 1 << 16)
    os.chdir("/work")
    _limit_and_drop(req["uid"], req["limits"], alive_r)
    env = {"PATH": req["path"], "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8", "USER": "sandbox"}
    env.update(req.get("env") or {})
    if req.get("argv"):
        os.close(TEST_FD)
        try:
            os.execvpe(req["argv"][0], req["argv"], env)
        except OSError as e:
            os.write(2, f"sandbox: cannot execute {req['argv'][0]!r}: {e.strerror}\n".encode())
            os._exit(127)
    os.environ.clear()
    os.environ.update(env)
    pyharness.run(req.get("code", ""), req.get("tests") or [], TEST_FD)
