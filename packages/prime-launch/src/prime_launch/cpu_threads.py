"""Thread counts for the processes ``rl`` runs on CPU.

Every torch process sizes its intra-op pool to all cores by default, so an inference server and a trainer on
the same CPU each run one thread per core and their OpenMP workers spin against each other: on 2 cores a
trainer step took 10-25x longer next to a busy server than alone. The launcher therefore splits the cores:
the orchestrator (HTTP and packing, no heavy torch ops) gets 1 thread and does not count against the cores;
the inference server (and a distillation teacher's) and each trainer rank get an even share, at least 1. Trainer ranks get equal counts
(collectives wait for the slowest rank), so a remainder goes to the inference server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Variables a CPU process gets its thread count in; torch sizes its intra-op pool from them at import."""


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container or ``taskset`` may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def split_cpu_threads(
    cores: int,
    *,
    inference: bool,
    trainer_ranks: int,
    explicit: Mapping[str, int] | None = None,
    teacher: bool = False,
) -> dict[str, int]:
    """Threads per process (``trainer``: per rank) for ``cores`` cores.

    ``inference`` (``teacher``) says whether the policy's (a distillation teacher's) server runs on this CPU. ``explicit`` holds the user's counts by
    role; those are kept and their cores (times the ranks, for the trainer) taken out before the rest is split.
    With fewer cores left than processes to share them, each gets 1 thread.
    """
    explicit = dict(explicit or {})
    threads = {"orchestrator": explicit.get("orchestrator", 1)}
    sharing = {}
    if inference:
        sharing["inference"] = 1
    if teacher:
        sharing["teacher"] = 1
    sharing["trainer"] = trainer_ranks
    left = cores
    for role, procs in list(sharing.items()):
        if role in explicit:
            threads[role] = explicit[role]
            left -= explicit[role] * procs
            del sharing[role]
    procs = sum(sharing.values())
    if procs:
        share, remainder = divmod(max(left, 0), procs)
        if share == 0:
            share, remainder = 1, 0
        for role in sharing:
            threads[role] = share
        if "inference" in sharing:
            threads["inference"] += remainder
    return threads
