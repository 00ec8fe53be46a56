"""Where this process's cgroups are: its own cgroup in each hierarchy (``/proc/self/cgroup``) and where each
hierarchy is mounted (``/proc/self/mountinfo``), for the pool's cgroups (:mod:`cgroups`) and an env server's own
(``prime_orchestrator.server_cgroup``). Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path

from prime_orchestrator.sandbox.delegate import LEAF

CONTROLLERS = ("memory", "pids", "cpuacct", "cpu", "blkio")
"""The cgroup v1 controllers the pool uses where they are mounted."""
ENV_SERVER_CGROUP = "prime-env-"
"""The name prefix of an env server's own v2 cgroup (``prime_orchestrator.server_cgroup``): a pool started in one
counts its parent as its own (a cgroup that holds processes cannot delegate controllers to its children)."""


def own_cgroups() -> dict[str, str]:
    """Controller (``""`` for v2) -> this process's cgroup path, from /proc/self/cgroup (an env server's own v2 cgroup,
    or the leaf a delegating pool moved its cgroup's processes into, counts as its parent)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    if "" in out and (os.path.basename(out[""]).startswith(ENV_SERVER_CGROUP) or out[""].endswith("/" + LEAF)):
        out[""] = os.path.dirname(out[""])
    return out


def mounts() -> dict[str, tuple[str, str]]:
    """Controller (``""`` for v2) -> (mount root inside the hierarchy, mount point), from mountinfo."""
    out: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        root, point = fields[3], fields[4].replace("\\040", " ")
        if fstype == "cgroup2":
            out.setdefault("", (root, point))
        elif fstype == "cgroup":
            for c in CONTROLLERS:
                if c in options:
                    out.setdefault(c, (root, point))
    return out


def path_of(controller: str, mounted: dict, own: dict) -> Path | None:
    """This process's cgroup directory in ``controller``'s hierarchy (``""``: v2), or None where it is not mounted."""
    if controller not in mounted or controller not in own:
        return None
    root, point = mounted[controller]
    rel = os.path.relpath(own[controller], root)
    return Path(point) / ("" if rel == "." else rel)
