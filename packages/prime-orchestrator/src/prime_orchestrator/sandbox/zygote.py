"""The zygote: one pre-warmed interpreter inside the sandbox namespaces, forking one supervisor per execution.

Stdlib only and started as ``python -I -S`` with an environment of two variables (no site-packages, nothing of the
host's environment on its stack). Life of the process:

1. Leave the host's session keyring for an anonymous one of its own.
2. As host root, in a new mount namespace: build the sandbox's root on a tmpfs (read-only binds of ``/usr``, the
   interpreter's directory and lib, a few ``/etc`` files, five device nodes), ``pivot_root`` into it, detach the
   host's tree and make the root read-only. Doing this before the user namespace exists lets it bind paths only
   host root may traverse (an interpreter under ``/root``), while the namespace's root never maps to host root.
3. ``unshare`` user, mount, network, IPC and UTS namespaces; the pool writes the uid/gid maps: inside 0 is an
   unprivileged host uid of the pool's range (``uid_base``), and the execution and workspace uids map to
   themselves. The mounts of step 2 are locked in the new namespace: its root cannot remount them.
4. Mount ``/.ws`` (a small tmpfs, mode 0700), under which each workspace is a tmpfs of its own size.
5. Pre-import the stdlib modules solutions use, freeze the GC heap (fewer copy-on-write faults after fork), say
   ``ready`` and serve: an ``x`` message (a request memfd, a result pipe and the execution's other descriptors, by
   SCM_RIGHTS) forks a supervisor (:mod:`supervisor`) and the zygote goes back to ``recvmsg`` at once, without
   reading the request: nothing of one execution stays in the memory the next one is forked from. A ``w`` message
   opens or closes a workspace.

EOF on the control socket (the pool is gone) ends the zygote; its supervisors die with it (PDEATHSIG), and
each execution's processes die with their supervisor.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import re
import resource
import signal
import socket
import stat
import sys

if __package__:  # imported as part of prime_orchestrator (tests, tools)
    from prime_orchestrator.sandbox import _linux as lx
    from prime_orchestrator.sandbox import supervisor
else:  # as the pool starts it: this folder on sys.path, no site-packages
    import _linux as lx
    import supervisor

PRELOAD = [
    "array",
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "textwrap",
    "traceback",
    "typing",
    "unicodedata",
]
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("ld.so.cache", "localtime", "nsswitch.conf", "alternatives")
# request, result, stdin, a program's relay, 5 cgroup.procs/tasks, CPU counter, OOM eventfd, usage, a program's
# cgroup.procs and /proc (supervisor.Commands)
MAX_FDS = 14
PR_SET_MEMORY_MERGE = 67
PROGRAMS_HIDDEN, PROGRAM_SITE = supervisor.PROGRAMS_HIDDEN, supervisor.PROGRAM_SITE
WORKSPACE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _bind_ro(source: str, target: str, devices: bool = False) -> None:
    if os.path.isdir(source) and not os.path.islink(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    lx.mount(source, target, None, lx.MS_BIND | lx.MS_REC)
    # A bind ignores MS_RDONLY on creation; only the remount makes it read-only.
    flags = lx.MS_BIND | lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID
    lx.mount(None, target, None, flags if devices else flags | lx.MS_NODEV)


def _top_level(path: str, root: str) -> None:
    """Mirror a top-level entry of the host (``/bin`` is a symlink on merged-/usr systems)."""
    if os.path.islink(path):
        os.symlink(os.readlink(path), root + path)
    elif os.path.isdir(path):
        _bind_ro(path, root + path)


def hide_sockets(top: str, root: str, at: str | None = None) -> int:
    """Cover every unix socket under the host directory ``top`` (bound at ``root + top``) with ``/dev/null`` mounted
    ``nodev``; how many. A read-only mount does not stop ``connect``, nor does the network namespace a path (only an
    abstract name): a host service listening on a socket the sandbox's uid may write (mode ``o+w``, as many services
    make theirs) in a path the pool binds took the code's bytes. ``at``: where ``top`` is bound (default: its own path). Walked once per zygote start, about 13 us an entry
    (0.8 s for the 59,000 of an interpreter's ``lib``, which is why only ``pool.ro_paths`` are walked)."""
    hidden, stack = 0, [top]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    target = root + (at or top) + entry.path[len(top) :]
                    lx.mount("/dev/null", target, None, lx.MS_BIND)
                    flags = lx.MS_BIND | lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID | lx.MS_NODEV
                    lx.mount(None, target, None, flags)
                    hidden += 1
            except OSError:
                continue
    return hidden


def bind_programs(root: str, programs: dict[str, str], owner: int) -> None:
    """Bind each of ``programs`` (entry name -> host path: a site-packages' package directories, modules and
    dist-info) under the hidden directory, owned by ``owner`` (the host uid that is root inside) and closed to
    everyone else; the mount point a program execution binds it on is made empty."""
    os.makedirs(root + PROGRAMS_HIDDEN + "/site", mode=0o755)
    os.chown(root + PROGRAMS_HIDDEN, owner, owner)
    os.chmod(root + PROGRAMS_HIDDEN, 0o700)
    for name, path in programs.items():
        at = PROGRAMS_HIDDEN + "/site/" + name
        _bind_ro(path, root + at)
        if os.path.isdir(path):
            hide_sockets(path, root, at)
    os.makedirs(root + PROGRAM_SITE)


def build_root(
    root: str, ro_paths: list[str], socket_walk: list[str] = (), programs: dict | None = None, owner: int = 0
) -> None:
    """As host root: a new mount namespace whose root is a read-only tmpfs built on the empty directory ``root``
    (the host sees an empty directory)."""
    os.umask(0o022)
    lx.unshare(lx.CLONE_NEWNS)
    lx.mount(None, "/", None, lx.MS_REC | lx.MS_PRIVATE)  # nothing we mount propagates back to the host
    lx.mount("tmpfs", root, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, "size=1m,mode=0755")
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        _top_level(top, root)
    for path in ro_paths:
        if os.path.exists(path) and not os.path.exists(root + path):
            _bind_ro(path, root + path)
            if path in socket_walk:
                hide_sockets(path, root)
    if programs:
        bind_programs(root, programs, owner)
    os.makedirs(root + "/etc")
    for name in ETC_FILES:
        if os.path.exists("/etc/" + name):
            _bind_ro(os.path.realpath("/etc/" + name), root + "/etc/" + name)
    with open(root + "/etc/passwd", "w") as f:
        f.write("root:x:0:0:root:/work:/bin/sh\n")
    with open(root + "/etc/hosts", "w") as f:
        f.write("127.0.0.1 localhost\n")
    os.makedirs(root + "/dev")
    for dev in DEVICES:
        _bind_ro("/dev/" + dev, root + "/dev/" + dev, devices=True)
    os.symlink("/work", root + "/tmp")  # one private writable tmpfs per execution, mounted on /work
    os.makedirs(root + "/work")
    os.makedirs(root + "/.ws")
    os.makedirs(root + "/.old")
    lx.pivot_root(root, root + "/.old")
    os.chdir("/")
    lx.umount("/.old")
    os.rmdir("/.old")
    lx.mount(None, "/", None, lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID | lx.MS_NODEV)


def enter_namespaces(ctl: socket.socket, sigpending: int | None = None) -> None:
    if sigpending is not None:  # before the user namespace: the kernel keeps it as the namespace's cap (zygotes.py)
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (sigpending, sigpending))
    lx.unshare(lx.CLONE_NEWUSER | lx.CLONE_NEWNS | lx.CLONE_NEWNET | lx.CLONE_NEWIPC | lx.CLONE_NEWUTS)
    ctl.send(b"unshared")
    if ctl.recv(64) != b"mapped":
        raise SystemExit("zygote: the pool did not write the uid map")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    socket.sethostname("sandbox")
    lx.mount("tmpfs", "/.ws", "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, "size=1m,nr_inodes=4096,mode=0700")


def workspace(op: dict) -> str:
    """Open (a tmpfs of ``disk_mb`` owned by the workspace's uid) or close a workspace; '' or the error."""
    name = op["name"]
    if not WORKSPACE_NAME.fullmatch(name):
        return f"bad workspace name {name!r}"
    path = "/.ws/" + name
    try:
        if op["op"] == "open":
            os.mkdir(path, 0o700)
            uid, size = op["uid"], op["disk_mb"]
            opts = f"size={size}m,nr_inodes={max(1024, size * 64)},mode=0700,uid={uid},gid={uid}"
            lx.mount("tmpfs", path, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, opts)
        else:
            lx.umount(path)
            os.rmdir(path)
    except OSError as e:
        return f"{op['op']} workspace {name}: {e.strerror or e}"
    return ""


def serve(ctl: socket.socket, seccomp: lx.SeccompProgram | None) -> None:
    zygote_pid = os.getpid()
    while True:
        try:
            msg, ancdata, _, _ = ctl.recvmsg(4096, socket.CMSG_SPACE(MAX_FDS * 4))
        except InterruptedError:
            continue
        if not msg:
            return
        fds = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4))
        if msg[:1] == b"x" and len(fds) >= 2:
            if os.fork() == 0:
                try:
                    supervisor.supervise(fds, ctl.fileno(), zygote_pid, seccomp)
                finally:
                    os._exit(70)
        elif msg[:1] == b"w" and fds:
            try:
                os.write(fds[0], workspace(json.loads(msg[1:])).encode() or b"ok")
            except (OSError, ValueError, KeyError) as e:
                os.write(fds[0], f"bad workspace message: {e}".encode())
        for fd in fds:
            os.close(fd)


def main(ctl_fd: int, setup_json: str) -> None:
    setup = json.loads(setup_json)
    ctl = socket.socket(fileno=ctl_fd)
    try:
        # KSM of the pool's process (systemd's MemoryKSM=yes) would pass to every execution, past the filter; a
        # kernel without KSM answers EINVAL: nothing to undo
        with contextlib.suppress(OSError):
            lx.prctl(PR_SET_MEMORY_MERGE, 0)
        lx.join_new_session_keyring()
        build_root(
            setup["root"], setup["ro_paths"], setup.get("socket_walk", []), setup.get("programs"), setup.get("owner", 0)
        )
        enter_namespaces(ctl, setup.get("sigpending"))
        program = base64.b64decode(setup["seccomp"]) if setup.get("seccomp") else b""
        seccomp = lx.SeccompProgram(program) if program else None
        for name in PRELOAD + setup.get("preload", []):
            __import__(name)
    except Exception as e:  # the pool reads this one line as the reason the sandbox cannot start
        ctl.send(f"error: {type(e).__name__}: {e}".encode())
        raise SystemExit(1) from None
    # Children are reaped by the kernel: the zygote never waits, it only forks.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.collect()
    gc.freeze()
    ctl.send(b"ready")
    serve(ctl, seccomp)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
