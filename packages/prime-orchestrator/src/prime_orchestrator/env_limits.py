"""The memory an env server's processes may allocate, each: a soft ``RLIMIT_DATA``.

Environments are third-party code, and a reward or tool the policy drives can be told to allocate without bound (a
reward that builds ``"x" * int(answer)``, a parser expanding ``9**9**9``). Unlimited, such a worker grew until the
kernel's OOM killer chose a victim on the host, as likely the inference server or the trainer as the worker itself,
and the run ended in a way that named neither the environment nor the cause. Under the limit the allocation fails
in the process that made it (``MemoryError`` in Python): the rollout fails in one line and is counted, and the
worker, the run and the host go on.

``RLIMIT_DATA`` counts a process's private writable memory (heap and anonymous mappings, Linux >= 4.7), not the
address space it reserves or the files it maps, so libraries that reserve large ranges are not refused. It is
inherited by every process the server starts (pool workers, tool servers, harness programs); only the soft limit is
set, so a process that needs more (a sandbox setting its own limits) may raise it to the hard one.
"""

from __future__ import annotations

import os
import resource

GIB = 1 << 30


def host_memory() -> int:
    """Bytes of physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(gib: float | None) -> int:
    """The limit in bytes: ``gib`` GiB, or half of the host's memory when unset."""
    return int(gib * GIB) if gib is not None else host_memory() // 2


def cap_memory(limit: int) -> None:
    """Set this process's soft ``RLIMIT_DATA`` to ``limit`` bytes (at most its hard limit; never raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    ceiling = min(x for x in (limit, soft, hard) if x != resource.RLIM_INFINITY) if limit else soft
    resource.setrlimit(resource.RLIMIT_DATA, (ceiling, hard))
