"""Sweeping the cgroups of pools that are gone: a pool killed (SIGKILL, a node's crash) never removes its cgroup.

A pool names its cgroup after its owner, ``<name>.<pid>-<start>-<pidns>`` (:func:`owned_name`: the pool's pid, its
start time in clock ticks, which a reused pid does not share, and its PID namespace: a pool of another namespace is
never judged by this one's ``/proc``). At start each pool removes, beside its own, the cgroups whose
owner is provably gone (no process of that pid, or one started at another time) and which hold no process, nor any of
their children; ``rmdir`` refusing a cgroup with tasks (``EBUSY``) is the last guard. A pool being created while
another sweeps is never touched: its owner is alive from before its first ``mkdir``. A cgroup without an owner in its
name (of a pool started before owners were named) is never removed: an empty one may be a live pool's that has not
run anything yet (a sweep that took those removed a running orchestrator's pool cgroups on the test VM).

Those go by hand, when no pool runs on the host: ``python -m prime_orchestrator.sandbox.stale --ownerless`` lists the
ownerless ``prime-sandbox-*`` cgroups of every cgroup hierarchy mounted, and ``--remove`` removes them (see
:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

OWNED = re.compile(r"\.(\d+)-(\d+)-(\d+)$")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot), or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owned_name(name: str) -> str:
    """``name`` tagged with this process as its owner."""
    return f"{name}.{os.getpid()}-{_start_time(os.getpid())}-{_pid_namespace()}"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _owner_gone(name: str) -> bool:
    if (m := OWNED.search(name)) is None:
        return False
    pid, start, namespace = (int(g) for g in m.groups())
    return namespace == _pid_namespace() and _start_time(pid) != start


def holds_processes(cgroup: Path) -> bool:
    """Whether any process is in ``cgroup`` or any cgroup below it."""
    for d, _, _ in os.walk(cgroup):
        try:
            if (Path(d) / "cgroup.procs").read_text().strip():
                return True
        except OSError:
            continue
    return False


def _remove(cgroup: Path) -> bool:
    """Remove an empty cgroup tree, deepest first; False when any of it stays (a process joined: EBUSY)."""
    for d, subdirs, _ in os.walk(cgroup, topdown=False):
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError):
                (Path(d) / sub).rmdir()
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return False  # another pool's sweep took it
    except OSError:
        return False
    return True


def sweep(shared: set[Path], own: set[Path]) -> int:
    """Remove the dead pools' cgroups under each ``shared`` directory, never one of ``own``; how many were removed."""
    removed = 0
    for directory in shared:
        try:
            entries = [e for e in directory.iterdir() if e.name.startswith("prime-sandbox-") and e.is_dir()]
        except OSError:
            continue
        for cgroup in entries:
            if cgroup in own or not _owner_gone(cgroup.name):
                continue
            if not holds_processes(cgroup) and _remove(cgroup):
                removed += 1
    return removed


def _hierarchies() -> list[Path]:
    """The mount point of every cgroup hierarchy (v1 and v2) this process sees."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] in ("cgroup", "cgroup2"):
            points.append(Path(fields[4].replace("\\040", " ")))
    return points


def ownerless(roots: list[Path]) -> dict[str, list[Path]]:
    """Pool name -> its cgroups, in any hierarchy below ``roots``, of every ``prime-sandbox-*`` cgroup without an
    owner in its name (not descended into: their children are the slots)."""
    found: dict[str, list[Path]] = {}
    for root in roots:
        for d, subdirs, _ in os.walk(root):
            pools = [s for s in subdirs if s.startswith("prime-sandbox-")]
            subdirs[:] = [s for s in subdirs if s not in pools]
            for name in pools:
                if OWNED.search(name) is None:
                    found.setdefault(name, []).append(Path(d) / name)
    return found


def _keep(name: str, cgroups: list[Path]) -> str:
    """Why the cgroups of pool ``name`` must stay ('' when none): judged across hierarchies, as one pool's. A live
    pool's zygotes hold its CPU cgroup only, and its memory (and pids) cgroups are empty while nothing runs."""
    if busy := next((c for c in cgroups if holds_processes(c)), None):
        return f"a process is in {busy}"
    if (folder := Path(tempfile.gettempdir()) / name).exists():
        return f"{folder} exists: a pool's that may be running (or was killed)"
    return ""


def main(argv: list[str] | None = None) -> int:
    """List (and with ``--remove`` remove) ownerless ``prime-sandbox-*`` cgroups; 1 when one could not go."""
    parser = argparse.ArgumentParser(
        prog="python -m prime_orchestrator.sandbox.stale",
        description="Ownerless prime-sandbox-* cgroups (of pools before their cgroups named their owner, or other "
        "tools), which no pool's start removes. Run it when no pool runs on the host: an idle pool of before holds "
        "no process in its memory (and pids) cgroups. A pool with a process in any of its cgroups, or whose folder is "
        "in the temporary directory, is kept.",
    )
    parser.add_argument("--ownerless", action="store_true", required=True, help="the cgroups without an owner")
    parser.add_argument("--remove", action="store_true", help="remove them (without it: list them)")
    parser.add_argument(
        "--under", type=Path, action="append", help="look only below this directory (repeatable; default: every "
        "cgroup hierarchy mounted)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    failed = 0
    for name, cgroups in sorted(ownerless(args.under or _hierarchies()).items()):
        if why := _keep(name, cgroups):
            print(f"kept {name}: {why}")
        elif not args.remove:
            print(f"empty {name}: " + " ".join(map(str, cgroups)))
        else:
            left = [c for c in cgroups if not _remove(c) and c.exists()]
            failed += bool(left)
            print(f"kept {name}: {' '.join(map(str, left))} busy" if left else f"removed {name}: {len(cgroups)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
