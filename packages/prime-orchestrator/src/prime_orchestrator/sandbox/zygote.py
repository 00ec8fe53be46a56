"""The zygote: one pre-warmed interpreter inside the sandbox namespaces, forking one supervisor per execution.

Stdlib only and started as ``python -I -S`` (no site-packages): the pool imports nothing of the project into
it. Life of the process:

1. ``unshare`` user, mount, network, IPC and UTS namespaces; the pool (host root, in the parent user namespace)
   writes the uid/gid maps: inside 0 is the zygote itself, ``[uid_base, uid_base + num_uids)`` are the
   execution uids (one per concurrent execution, mapped to the same host uids, which own nothing).
2. Build a new root on a tmpfs: read-only binds of ``/usr`` and the interpreter's prefix, a few ``/etc`` files,
   five device nodes, a ``/.ws`` bind of the pool's workspace folder; ``pivot_root`` into it and detach the
   host's tree, so nothing else of the host (its ``/etc/shadow``, ``/root``, the project) exists in here.
3. Pre-import the stdlib modules solutions use, freeze the GC heap (fewer copy-on-write faults after fork),
   say ``ready`` and serve: each request (JSON + a result pipe + an optional stdin memfd over SCM_RIGHTS)
   forks a supervisor (:mod:`supervisor`), and the zygote goes back to ``recvmsg`` at once.

EOF on the control socket (the pool is gone) ends the zygote; its supervisors die with it (PDEATHSIG), and
each execution's processes die with their supervisor.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
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
MAX_REQUEST = 16 << 20


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


def build_root(root: str, ro_paths: list[str], workspaces: str) -> None:
    """Mount the sandbox's root filesystem on the empty directory ``root`` and pivot into it (the tmpfs
    exists only in this mount namespace: the host sees an empty directory)."""
    lx.mount(None, "/", None, lx.MS_REC | lx.MS_PRIVATE)  # nothing we mount propagates back to the host
    lx.mount("tmpfs", root, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, "size=1m,mode=0755")
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        _top_level(top, root)
    for path in ro_paths:
        if os.path.exists(path) and not os.path.exists(root + path):
            _bind_ro(path, root + path)
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
    os.makedirs(root + "/.ws", mode=0o700)
    lx.mount(workspaces, root + "/.ws", None, lx.MS_BIND)
    lx.mount(None, root + "/.ws", None, lx.MS_BIND | lx.MS_REMOUNT | lx.MS_NOSUID | lx.MS_NODEV)
    os.makedirs(root + "/.old")
    lx.pivot_root(root, root + "/.old")
    os.chdir("/")
    lx.umount("/.old")
    os.rmdir("/.old")
    lx.mount(None, "/", None, lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID | lx.MS_NODEV)


def enter_namespaces(ctl: socket.socket) -> None:
    lx.unshare(lx.CLONE_NEWUSER | lx.CLONE_NEWNS | lx.CLONE_NEWNET | lx.CLONE_NEWIPC | lx.CLONE_NEWUTS)
    ctl.send(b"unshared")
    if ctl.recv(64) != b"mapped":
        raise SystemExit("zygote: the pool did not write the uid map")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    socket.sethostname("sandbox")


def serve(ctl: socket.socket) -> None:
    while True:
        try:
            msg, ancdata, _, _ = ctl.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(8))
        except InterruptedError:
            continue
        if not msg:
            return
        fds = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(int.from_bytes(data[i : i + 4], sys.byteorder) for i in range(0, len(data), 4))
        zygote_pid = os.getpid()
        if os.fork() == 0:
            try:
                supervisor.supervise(json.loads(msg), fds, ctl.fileno(), zygote_pid)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)


def main(ctl_fd: int, setup_json: str) -> None:
    setup = json.loads(setup_json)
    ctl = socket.socket(fileno=ctl_fd)
    try:
        enter_namespaces(ctl)
        build_root(setup["root"], setup["ro_paths"], setup["workspaces"])
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
    serve(ctl)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
