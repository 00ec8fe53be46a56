"""A cgroup v2 pool that runs in a cgroup holding processes delegates the controllers itself.

cgroup v2 lets a cgroup hand controllers to its children (``cgroup.subtree_control``) only while it holds no process
itself. A pool started in an ordinary leaf (a shell's session scope, a systemd service, a GPU host's job cgroup) is
in such a cgroup: it had no memory, pids, CPU or disk cgroups at all, only the per-process rlimits (a GPU host's
sandbox ran so). Where the parent gives the cgroup ``memory`` (``cgroup.controllers``; ``pids``, ``cpu`` and ``io``
too where given) and the pool may write it (root, or a delegated subtree: systemd's ``Delegate=yes`` asks the
service to do exactly this), it moves every process of its cgroup into a leaf child, :data:`LEAF`, and enables them
for its children. The processes stay in the same subtree, under the same limits; the pool's cgroups go beside the
leaf.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
LEAF = "prime-processes"
"""The child a cgroup's own processes move into; a pool whose cgroup has this name counts its parent as its own."""
NEEDED = ("memory",)
WANTED = ("pids", "cpu", "io")
"""Enabled too where given: each execution's task count (and every pool's together, ``memcap.task_cap``), CPU weight
and disk reads. A GPU host's job cgroup is given ``memory`` alone: its pools bound tasks by RLIMIT_NPROC only."""
MOVE_ROUNDS = 20
"""Passes over the cgroup's processes: one forked while they move lands in the cgroup again (no wait between)."""


def delegate(cgroup: Path) -> str:
    """Enable the memory controller (and pids, cpu, io where given) for ``cgroup``'s children by moving its own
    processes into ``cgroup/LEAF``; '' when done (or when all it is given is enabled already), else why not (one
    line)."""
    try:
        given = set((cgroup / "cgroup.controllers").read_text().split())
        if not set(NEEDED) <= given:
            return f"{cgroup} is not given the memory controller by its parent (cgroup.controllers)"
        enabled = set((cgroup / "cgroup.subtree_control").read_text().split())
        todo = [c for c in (*NEEDED, *WANTED) if c in given and c not in enabled]
        if not todo:
            return ""
        leaf = cgroup / LEAF
        leaf.mkdir(exist_ok=True)
        moved = _move_all(cgroup, leaf)
        for controller in todo:
            try:
                (cgroup / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError:
                if controller in NEEDED:
                    raise
    except OSError as e:
        return f"{cgroup} does not delegate memory, and enabling it failed ({e.strerror or e})"
    logger.info(
        "sandbox pool: moved %d processes of %s into %s to give its cgroups %s", moved, cgroup, LEAF, " ".join(todo)
    )
    return ""


def _move_all(cgroup: Path, leaf: Path) -> int:
    moved = 0
    for _ in range(MOVE_ROUNDS):
        pids = (cgroup / "cgroup.procs").read_text().split()
        if not pids:
            return moved
        for pid in pids:
            try:
                (leaf / "cgroup.procs").write_text(pid)
                moved += 1
            except OSError as e:
                if e.errno != errno.ESRCH:  # one that exited meanwhile is no matter
                    raise
    raise OSError(errno.EBUSY, f"processes kept appearing in it over {MOVE_ROUNDS} passes")
