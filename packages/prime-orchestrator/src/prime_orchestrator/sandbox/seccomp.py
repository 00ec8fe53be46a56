"""The system-call filter of every execution: an allowlist compiled to a BPF program on the host, by libseccomp.

The pool compiles the policy once, at start, through libseccomp (``libseccomp2``, installed on Debian and Ubuntu
with apt itself, so present on every such host) and hands the program's bytes to its zygotes; a runner installs
them with ``prctl(PR_SET_SECCOMP)`` as its last step before the code runs. Nothing of libseccomp enters the sandbox.

The policy is an allowlist in the spirit of Docker's default profile, narrowed for code grading:

- every system call not listed fails with ``ENOSYS`` (a libc falls back from a newer call it does not find, e.g.
  ``clone3`` to ``clone``); a new kernel's calls are denied until someone reviews them;
- the calls a sandbox escape or a kernel exploit usually starts from fail with ``EPERM`` (:data:`DENIED`): new
  namespaces, ``setns``, mounts, keyrings, ``io_uring``, ``bpf``, ``perf_event_open``, ``ptrace`` and cross-process
  memory access, ``userfaultfd``, modules and kexec, SysV and POSIX IPC, ``memfd_create`` (memory RLIMIT_AS does
  not count), and the host-administration calls;
- ``flock`` is not listed (``ENOSYS``): a lock on a bound host file is the host's inode's lock, which a host process
  taking it would wait on, and the filter cannot tell such a descriptor from one in ``/work``. ``ENOSYS`` is what a
  kernel without the call answers, so a lock library gives up at once (Python's ``filelock`` raises
  ``NotImplementedError``; on ``EPERM`` it would retry until the wall limit). POSIX locks (``fcntl``, which sqlite
  uses) stay: on a read-only descriptor they can only take read locks;
- ``splice``, ``sendfile`` and ``vmsplice`` are not listed (``ENOSYS``, after which Python's ``shutil`` and the
  usual tools copy with ``read`` and ``write``): into a pipe they put references to a bound host file's page-cache
  folios, not copies, and a referenced folio is never reclaimed. 124 pipe buffers, one page every 2 MiB, pinned
  147 MiB of the host's page cache (whole large folios) with 1.2 MiB charged to the execution;
- ``fsync``, ``fdatasync``, ``sync_file_range`` and ``msync`` with ``MS_SYNC`` return 0 without running
  (:data:`NOOP`): they do nothing on the tmpfs the code writes, and on a read-only bind's descriptor they wrote back
  the host's dirty data of that file, waiting for it uninterruptibly; so do the requests for read-ahead
  (``readahead``, ``fadvise64``'s and ``madvise``'s ``WILLNEED``), whose reads of bound files outlived the execution
  behind its slot's disk throttle;
- ``fcntl`` is allowed but for ``F_NOTIFY`` (``inotify``'s older form) and ``fadvise64`` but for
  ``POSIX_FADV_DONTNEED``, which drops a bound host file's pages from the host's page cache;
- ``prctl`` is allowed but for ``PR_SCHED_CORE`` (``EPERM``): a core-scheduling cookie of its own forces the SMT
  sibling of the code's core idle whenever the code runs there, CPU charged to nobody;
- KSM is out of reach: ``prctl(PR_SET_MEMORY_MERGE)`` and ``madvise(MADV_MERGEABLE)`` fail with ``EINVAL``, what a
  kernel built without KSM answers (every other ``madvise`` advice works): merged pages are a timing side channel
  between executions (a write to a page shared with another's takes a copy-on-write fault), and ``ksmd`` scans them
  on host CPU charged to no execution;
- ``mbind`` is allowed but with ``MPOL_MF_MOVE`` or ``MPOL_MF_MOVE_ALL`` (``EPERM``, what the second answers
  without ``CAP_SYS_NICE``), and ``migrate_pages`` and ``move_pages`` are denied: they migrate pages between NUMA
  nodes now, on the host's CPU and memory bandwidth; a policy for later allocations (plain ``mbind``,
  ``set_mempolicy``) stays;
- ``preadv2`` is allowed but with ``RWF_NOWAIT`` (``EOPNOTSUPP``, what a file that cannot be read without waiting
  answers, so a caller reads it the usual way): it answered ``EAGAIN`` for a page the host's page cache does not
  hold, the probe of which host files the host and the neighbours read that ``mincore`` and ``cachestat`` are
  denied for;
- ``mmap`` is allowed but with ``MAP_HUGETLB`` (``ENOMEM``): the host's reserved huge pages are not charged to the
  execution's memory cgroup;
- ``clone`` is allowed without namespace flags; ``socket`` for ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` only
  (other families ``EAFNOSUPPORT``); ``personality`` for the values Docker allows;
- a call made through another ABI (i386 ``int 0x80``, x32) fails with ``ENOSYS``, so no number of a second table is
  reached. A kill would be logged by the kernel whatever the filter asks (``kernel.seccomp.actions_logged``): an
  audit record to auditd's file on the host's disk where it runs, else the kernel log, for every child of a fork
  loop making one such call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import cache


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# The calls a Python solution, a shell and the usual compilers and runtimes make. Unknown names (another
# architecture's, or newer than this host's libseccomp) are skipped.
ALLOWED = _names(
    # files and descriptors
    "read write readv writev pread64 pwrite64 preadv pwritev pwritev2 open openat openat2 creat close "
    "close_range lseek dup dup2 dup3 ioctl truncate ftruncate fallocate "
    "tee copy_file_range pipe pipe2 "
    # metadata and directories
    "stat lstat fstat newfstatat statx statfs fstatfs access faccessat faccessat2 readlink readlinkat getdents "
    "getdents64 getcwd chdir fchdir mkdir mkdirat rmdir rename renameat renameat2 link linkat symlink symlinkat "
    "unlink unlinkat chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes utimensat futimesat "
    "umask mknod mknodat getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr setxattr lsetxattr fsetxattr "
    "removexattr lremovexattr fremovexattr getxattrat setxattrat listxattrat removexattrat file_getattr "
    "file_setattr "
    # memory
    "brk munmap mremap mprotect pkey_mprotect pkey_alloc pkey_free mlock mlock2 munlock mlockall "
    "munlockall membarrier mseal map_shadow_stack get_mempolicy set_mempolicy "
    "set_mempolicy_home_node "
    # (madvise and mbind: see _rules) processes and threads (clone and prctl: see _rules)
    "fork vfork execve execveat exit exit_group wait4 waitid kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo "
    "getpid getppid gettid getpgid setpgid getpgrp getsid setsid getuid geteuid getgid getegid getresuid getresgid "
    "getgroups setuid setgid setreuid setregid setresuid setresgid setfsuid setfsgid setgroups capget capset "
    "arch_prctl set_tid_address set_robust_list get_robust_list rseq sched_yield sched_getaffinity "
    "sched_setaffinity sched_getparam sched_setparam sched_getscheduler sched_setscheduler sched_get_priority_max "
    "sched_get_priority_min sched_rr_get_interval sched_getattr sched_setattr getpriority setpriority getrlimit "
    "setrlimit prlimit64 getrusage times uname sysinfo getrandom getcpu pidfd_open pidfd_send_signal "
    "restart_syscall ioprio_get ioprio_set seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self "
    # signals, time, waiting
    "rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigsuspend sigaltstack signalfd "
    "signalfd4 pause alarm getitimer setitimer timer_create timer_settime timer_gettime timer_getoverrun "
    "timer_delete clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time timerfd_create "
    "timerfd_settime timerfd_gettime select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl epoll_wait "
    "epoll_pwait epoll_pwait2 eventfd eventfd2 futex futex_waitv futex_wait futex_wake futex_requeue "
    # sockets (socket itself: see CONDITIONAL); the execution's network namespace has no interface up
    "socketpair bind connect listen accept accept4 getsockname getpeername sendto recvfrom sendmsg recvmsg sendmmsg "
    "recvmmsg shutdown setsockopt getsockopt"
)

# Denied with EPERM, so the code (and a reader of its traceback) sees a refusal rather than a missing call.
DENIED = _names(
    # namespaces, mounts, root changes
    "unshare setns mount umount2 pivot_root chroot move_mount open_tree open_tree_attr fsopen fsconfig fsmount "
    "fspick mount_setattr statmount listmount "
    # keyrings
    "keyctl add_key request_key "
    # kernel surfaces with a record of exploits
    "io_uring_setup io_uring_enter io_uring_register bpf perf_event_open userfaultfd io_setup io_destroy io_submit "
    "io_cancel io_getevents io_pgetevents "
    # other processes' memory and descriptors
    "ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd process_madvise process_mrelease "
    "name_to_handle_at open_by_handle_at "
    # memory no limit counts, and IPC objects that outlive their process
    "memfd_create memfd_secret shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl "
    "mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr migrate_pages move_pages "
    # host administration
    "init_module finit_module delete_module kexec_load kexec_file_load reboot swapon swapoff acct quotactl "
    "quotactl_fd syslog settimeofday clock_settime clock_adjtime adjtimex sethostname setdomainname iopl ioperm "
    "modify_ldt fanotify_init fanotify_mark vhangup sync lookup_dcookie nfsservctl uselib ustat sysfs _sysctl "
    # syncfs on a descriptor of a read-only bind (/usr) writes back the host filesystem under it, the one holding
    # the run's checkpoints, and waits for it uninterruptibly: ``sync`` by another name
    "syncfs "
    # What is bound from the host (/usr, the interpreter) is the host's own inodes: watching them shows when the host
    # and the neighbours read them, and page-cache residency (mincore, cachestat) shows which files they used.
    "inotify_init inotify_init1 inotify_add_watch inotify_rm_watch mincore cachestat"
)

# Return 0 without running (msync: with MS_SYNC). Everything the code can write is a tmpfs, where they do nothing;
# on a descriptor of a read-only bind they wrote back the host's dirty data of that file (256 MiB of a checkpoint
# being written, in 0.16 s) and fsync committed the host filesystem's journal, waiting for it uninterruptibly.
NOOP = _names("fsync fdatasync sync_file_range readahead")
MS_SYNC = 4
# The host's reserved huge pages are not charged to the memory cgroup: an execution limited to 64 MiB took 22 of
# 32 (ENOMEM: what a host without reserved huge pages answers, so allocators fall back to ordinary pages).
MAP_HUGETLB = 0x40000
RWF_NOWAIT = 0x8  # preadv2's flags (its sixth argument on every architecture)
F_NOTIFY = 1026
POSIX_FADV_DONTNEED = 4
# Read-ahead on request (readahead, fadvise64's and madvise's WILLNEED, return 0 without running): it queues the reads
# behind the slot's disk throttle and returns at once, and they outlive the execution. 289 MiB of bound files queued
# in 0.2 s kept the disk reading for the slot 6 s after the verdict: the next execution in the slot read a cold 29 MiB
# file in 6.4 s (0.6 s alone), its memory cgroup charged with the 289 MiB meanwhile, and a host process reading a
# queued file waited 5.6 s for 76 MB.
POSIX_FADV_WILLNEED = MADV_WILLNEED = 3
# Core scheduling: a cookie of its own keeps every other task off the SMT sibling of the core the code runs on (forced
# idle, charged to nobody), so one execution's CPU took a whole core and the neighbours' (the trainer's) share of it.
PR_SCHED_CORE = 62
PR_SET_MEMORY_MERGE = 67
MADV_MERGEABLE = 12
MPOL_MF_MOVE, MPOL_MF_MOVE_ALL = 1 << 1, 1 << 2
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # as Docker: PER_LINUX, UNAME26, ADDR_NO_RANDOMIZE, query

_ACT_ALLOW = 0x7FFF0000
_CMP_EQ, _CMP_GT, _CMP_MASKED_EQ = 4, 6, 7
_ATTR_ACT_BADARCH, _ATTR_OPTIMIZE = 2, 8


def _errno(value: int) -> int:
    return 0x00050000 | (value & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused the policy; the message says which."""


@cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(
            f"libseccomp not found ({e}): install libseccomp2, or set pool.seccomp = false to run without a "
            "system-call filter"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _add(lib, ctx, action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:  # not a call of this architecture (or unknown to this libseccomp)
        return
    array = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
    ret = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
    if ret < 0:
        raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-ret)}")


def _rules(lib, ctx) -> None:
    for name in ALLOWED:
        _add(lib, ctx, _ACT_ALLOW, name)
    for name in DENIED:
        _add(lib, ctx, _errno(errno.EPERM), name)
    for name in NOOP:
        _add(lib, ctx, _errno(0), name)
    _add(lib, ctx, _ACT_ALLOW, "mmap", (3, _CMP_MASKED_EQ, MAP_HUGETLB, 0))
    _add(lib, ctx, _errno(errno.ENOMEM), "mmap", (3, _CMP_MASKED_EQ, MAP_HUGETLB, MAP_HUGETLB))
    _add(lib, ctx, _ACT_ALLOW, "preadv2", (5, _CMP_MASKED_EQ, RWF_NOWAIT, 0))
    _add(lib, ctx, _errno(errno.EOPNOTSUPP), "preadv2", (5, _CMP_MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    _add(lib, ctx, _ACT_ALLOW, "msync", (2, _CMP_MASKED_EQ, MS_SYNC, 0))
    _add(lib, ctx, _errno(0), "msync", (2, _CMP_MASKED_EQ, MS_SYNC, MS_SYNC))
    _add(lib, ctx, _ACT_ALLOW, "clone", (0, _CMP_MASKED_EQ, NAMESPACE_FLAGS, 0))
    for bit in range(32):
        if NAMESPACE_FLAGS & (1 << bit):
            _add(lib, ctx, _errno(errno.EPERM), "clone", (0, _CMP_MASKED_EQ, 1 << bit, 1 << bit))
    for family in SOCKET_FAMILIES:
        _add(lib, ctx, _ACT_ALLOW, "socket", (0, _CMP_EQ, family, 0))
    for family in (0, 3, 4, 5, 6, 7, 8, 9):
        _add(lib, ctx, _errno(errno.EAFNOSUPPORT), "socket", (0, _CMP_EQ, family, 0))
    _add(lib, ctx, _errno(errno.EAFNOSUPPORT), "socket", (0, _CMP_GT, 10, 0))
    for value in PERSONALITIES:
        _add(lib, ctx, _ACT_ALLOW, "personality", (0, _CMP_EQ, value, 0))
    moves = MPOL_MF_MOVE | MPOL_MF_MOVE_ALL
    _add(lib, ctx, _ACT_ALLOW, "mbind", (5, _CMP_MASKED_EQ, moves, 0))
    for flag in (MPOL_MF_MOVE, MPOL_MF_MOVE_ALL):
        _add(lib, ctx, _errno(errno.EPERM), "mbind", (5, _CMP_MASKED_EQ, flag, flag))
    _allow_unless(lib, ctx, "fcntl", 1, {F_NOTIFY: errno.EPERM})
    _allow_unless(lib, ctx, "fadvise64", 3, {POSIX_FADV_DONTNEED: errno.EPERM, POSIX_FADV_WILLNEED: 0})
    _allow_unless(lib, ctx, "prctl", 0, {PR_SCHED_CORE: errno.EPERM, PR_SET_MEMORY_MERGE: errno.EINVAL})
    _allow_unless(lib, ctx, "madvise", 2, {MADV_MERGEABLE: errno.EINVAL, MADV_WILLNEED: 0})


def _allow_unless(lib, ctx, name: str, arg: int, refused: dict[int, int]) -> None:
    """``name`` allowed unless its ``int`` argument ``arg`` is one of ``refused`` (one or two values, each failing
    with its errno). The kernel reads only the low 32 bits, so every comparison masks them: a refused value with high
    bits set is still refused. No allowance overlaps a refusal (libseccomp does not order rules of different actions
    that match the same call): the argument differs from every refused value in a bit where they agree (one rule per
    such bit), or, for two values, differs from the first in one bit where they differ and from the second in
    another (one rule per such pair of bits)."""
    assert 1 <= len(refused) <= 2, refused
    first, *rest = refused
    second = rest[0] if rest else first
    differ = (first ^ second) & 0xFFFFFFFF
    for bit in range(32):
        if not differ & (1 << bit):
            _add(lib, ctx, _ACT_ALLOW, name, (arg, _CMP_MASKED_EQ, 1 << bit, ~first & (1 << bit)))
    bits = [1 << b for b in range(32) if differ & (1 << b)]
    for one in bits:
        for two in bits:
            if one != two:
                want = (~first & one) | (~second & two)
                _add(lib, ctx, _ACT_ALLOW, name, (arg, _CMP_MASKED_EQ, one | two, want))
    for value, error in refused.items():
        _add(lib, ctx, _errno(error), name, (arg, _CMP_MASKED_EQ, 0xFFFFFFFF, value))


@cache
def compile_filter() -> bytes:
    """The BPF program (``struct sock_filter`` array) of the policy for this host's architecture."""
    lib = _lib()
    ctx = lib.seccomp_init(_errno(errno.ENOSYS))
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _errno(errno.ENOSYS))  # not a kill: kills are logged
        lib.seccomp_attr_set(ctx, _ATTR_OPTIMIZE, 2)  # a binary tree over the call numbers (libseccomp >= 2.5)
        _rules(lib, ctx)
        fd = os.memfd_create("seccomp-bpf")
        try:
            ret = lib.seccomp_export_bpf(ctx, fd)
            if ret < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf: {os.strerror(-ret)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
