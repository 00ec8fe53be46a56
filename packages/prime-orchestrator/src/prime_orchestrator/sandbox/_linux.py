"""The few Linux system calls the sandbox needs, through ctypes (Python 3.11 has no ``os.unshare``).

Stdlib only: the zygote imports this module by path, before any site-packages exist for it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import socket
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
# Calls without a libc wrapper: their numbers differ between x86_64 and the generic table (aarch64).
_NR = {"pivot_root": 155, "keyctl": 250}
if platform.machine() in ("aarch64", "arm64"):
    _NR = {"pivot_root": 41, "keyctl": 219}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_NR["pivot_root"], _b(new_root), _b(put_old)), "pivot_root")


def prctl(option: int, arg: int = 0, arg2: int = 0) -> None:
    _check(_libc.prctl(option, arg, arg2, 0, 0), f"prctl({option})")


def join_new_session_keyring() -> None:
    """Subscribe to a fresh anonymous session keyring: the one inherited from the host is no longer possessed."""
    ret = _libc.syscall(_NR["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)}")


_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` of this process's network namespace up (needs CAP_NET_ADMIN over it): ``127.0.0.1`` and ``::1``
    then reach only this namespace's own listeners."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompProgram:
    """A BPF program (``struct sock_filter`` bytes) ready to install; built once in the zygote, installed by each
    runner after ``no_new_privs`` with one ``prctl``."""

    def __init__(self, program: bytes) -> None:
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._prog = _SockFprog(len(program) // 8, ctypes.addressof(self._buf))

    def install(self) -> None:
        _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog), 0, 0), "seccomp")
