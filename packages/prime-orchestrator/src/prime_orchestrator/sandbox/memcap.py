"""Bounds above the slots: the memory and tasks the executions of a pool, and of every pool of the host, hold together.

Each slot's memory and pids cgroups bound one execution (:mod:`cgroups`); these bound their sum, on the shared
``prime-sandbox`` cgroup (:func:`memory_cap`, :func:`task_cap`) and on a pool's own (``Cgroups.limit_total``). Stdlib
only.
"""

from __future__ import annotations

import os
from pathlib import Path


def memory_cap() -> int | None:
    """Bytes the executions of every pool of the host may hold together: half of the host's memory, on the shared
    cgroup (``cgroups.SHARED``), as :func:`task_cap` for tasks. Each slot's memory cgroup bounds one execution alone,
    and ``max_concurrency × memory_mb`` goes past any host's memory (256 × program_limits' 2 GiB is 512 GiB): 8 executions
    of 256 MB held 1,853 MB together on the 24 GiB test VM, unbounded by anything but the host's own OOM killer,
    which picks from the whole host (the trainer, the inference server). ``SandboxPoolConfig.total_memory_mb`` bounds
    one pool lower."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (OSError, ValueError):
        return None


def memory_files(d: Path) -> list[Path]:
    """The files bounding the memory of cgroup ``d`` (v1 with swap accounting: both; none in another hierarchy)."""
    names = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max")
    return [d / n for n in names if (d / n).exists()]


def limit_memory(d: Path, nbytes: int) -> None:
    """Bound cgroup ``d``'s memory (v1: memsw never below the limit, so written in the order that keeps it so)."""
    files = memory_files(d)
    try:
        old = int(files[0].read_text()) if files else 0
    except ValueError:  # v2's "max"
        old = 1 << 62
    for path in files if nbytes < old else reversed(files):
        path.write_text(str(nbytes))


def task_cap() -> int | None:
    """Tasks (processes and threads) the executions of every pool of the host may hold together: half of what the
    host may have (the lower of ``kernel.pid_max`` and ``kernel.threads-max``), on the shared cgroup
    (``cgroups.SHARED``). Each execution's pids cgroup bounds it alone, and ``max_concurrency × processes`` may add up to more than the
    host has (512 × 64 is the whole pid space of the test VM, 32,768): every fork and thread start on the host, the
    trainer's and the inference server's, then failed. On each pool's own cgroup, two pools of one host (two env
    servers, an orchestrator and an eval) each took half: together, all of it. Where the pool has no pids cgroup
    (a cgroup given ``memory`` alone) nothing writes it, and the pool lists it as not enforced."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        return min(pid_max, int(Path("/proc/sys/kernel/threads-max").read_text())) // 2
    except (OSError, ValueError):
        return None
