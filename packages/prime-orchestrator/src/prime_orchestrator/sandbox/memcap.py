"""Memory bounds above the slots: what the executions of a pool, and of every pool of the host, hold together.

Each slot's memory cgroup bounds one execution (:mod:`cgroups`); these bound their sum, on the shared
``prime-sandbox`` cgroup (:func:`memory_cap`) and on a pool's own (``Cgroups.limit_total``). Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path


def memory_cap() -> int | None:
    """Bytes the executions of every pool of the host may hold together: half of the host's memory, on the shared
    cgroup (``cgroups.SHARED``), as ``cgroups.task_cap`` for tasks. Each slot's memory cgroup bounds one execution alone, and
    ``max_concurrency × memory_mb`` goes past any host's memory (256 × program_limits' 2 GiB is 512 GiB): 8 executions
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
