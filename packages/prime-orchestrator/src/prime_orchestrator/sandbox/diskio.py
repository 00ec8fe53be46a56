"""Disk reads of executions: throttled on the block devices behind what the sandbox binds, by their cgroup.

An execution writes only to tmpfs, but it reads the host's files bound into it (``/usr``, the interpreter, ``ro_paths``)
and can read them from the disk as fast as the disk goes: with ``O_DIRECT`` (no page cache, so no memory cgroup sees
it) or more of them than its memory cgroup holds. One execution read the 2-core test VM's root disk at 300-450 MB/s
for its whole wall limit, beside the trainer's checkpoints. The kernel throttles reads per cgroup and per block device:
v1 ``blkio.throttle.read_bps_device`` and ``read_iops_device``, v2 ``io.max`` (``rbps``, ``riops``). So the pool finds
the devices (:func:`read_devices`) and writes each slot's limits there (:class:`DiskLimits`).

v1 throttling is flat: a limit on a cgroup does not bound the cgroups below it (a parent at 20 MB/s, its child read at
457 MB/s on the test VM), so only v2 can also bound all of a pool's executions together (``io.max`` on the pool's
cgroup, ``SandboxPoolConfig.total_disk_read_mbps``). Stdlib only.
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prime_core.config.sandbox import SandboxPoolConfig

    from prime_orchestrator.sandbox.cgroups import Cgroups

MB = 1_000_000
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2"})
"""Filesystems with no disk under them: reading their files reads no block device."""
TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Host directories every zygote binds (``zygote.build_root``; of ``/etc`` a few files), besides the interpreter's
directories, ``ro_paths`` and the programs' packages."""


def _mountinfo() -> list[tuple[str, str, str, str]]:
    """(mount point, ``MAJ:MIN``, filesystem type, source) of each mount this process sees."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((fields[4].replace("\\040", " "), fields[2], fields[sep + 1], fields[sep + 2]))
    return out


def whole_disk(dev: str) -> str | None:
    """The ``MAJ:MIN`` to throttle for block device ``dev``: a partition's disk (the kernel refuses a partition's
    limits: ``EINVAL``), a disk, device-mapper or md device itself; None where sysfs does not show it."""
    sysfs = Path("/sys/dev/block") / dev
    try:
        if not (sysfs / "partition").exists():
            return dev if sysfs.exists() else None
        return (sysfs.resolve().parent / "dev").read_text().strip()
    except OSError:
        return None


def _device_of(path: str, dev: int, mounts: list) -> tuple[str | None, str]:
    """The block device (``MAJ:MIN``) under ``path`` on the filesystem of ``dev``, or None and why not ('' when its
    filesystem has no disk), said of all such paths."""
    if os.major(dev):
        number = f"{os.major(dev)}:{os.minor(dev)}"
        return (disk, "") if (disk := whole_disk(number)) else (None, f"sysfs shows no /sys/dev/block/{number}")
    # An anonymous device: a filesystem without a disk (tmpfs), or one hiding it (overlay, NFS, FUSE; btrfs, whose
    # mount names its disk)
    number = f"0:{os.minor(dev)}"
    here = [m for m in mounts if m[1] == number and (path + "/").startswith(m[0].rstrip("/") + "/")]
    point, _, fstype, source = max(here, default=("", "", "unknown", ""), key=lambda m: len(m[0]))
    if fstype in MEMORY_FS:
        return None, ""
    try:
        st = os.stat(source) if source.startswith("/dev/") else None
    except OSError:
        st = None
    if (
        st is not None
        and stat.S_ISBLK(st.st_mode)
        and (disk := whole_disk(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"))
    ):
        return disk, ""
    return None, f"on {fstype} (no block device to throttle)"


def read_devices(paths: list[str]) -> tuple[list[str], list[str]]:
    """The whole-disk ``MAJ:MIN`` of every block device an execution can read through ``paths`` (each path's own
    filesystem and those mounted below it: the sandbox binds recursively), and what hides one (an overlay, network
    or FUSE filesystem; sysfs not showing the device). Paths that do not exist are left out."""
    mounts = _mountinfo()
    devices, hidden = set(), {}
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        try:
            found = [(path, os.stat(path).st_dev)]
        except OSError:
            continue
        below = [m for m in mounts if m[0].startswith(path.rstrip("/") + "/")]
        found += [(point, os.makedev(*map(int, number.split(":")))) for point, number, _, _ in below]
        for where, dev in found:
            disk, why = _device_of(where, dev, mounts)
            if disk:
                devices.add(disk)
            elif why:
                hidden.setdefault(why, []).append(where)
    # One line per reason: in a container whose root is an overlay, every one of the ~90 paths bound is on it
    return sorted(devices), [f"{_some(paths)} {why}" for why, paths in hidden.items()]


def _some(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


class DiskLimits:
    """Read limits (bytes and reads per second) per cgroup on each of ``devices``, written only when they change; the
    pool's blkio (v1) or io (v2) cgroup is ``root``, each slot's and workspace's below it."""

    def __init__(self, devices: list[str], version: int, root: Path) -> None:
        self.devices = devices
        self.version = version
        self.root = root
        self._set: dict[Path, tuple[int | None, int | None]] = {}

    def limit(self, key: str, mbps: int | None, iops: int | None) -> None:
        """:meth:`apply` to the cgroup of ``key`` (a slot's or a workspace's, made by ``Cgroups.enter``)."""
        self.apply(self.root / key, mbps, iops)

    def apply(self, cgroup: Path, mbps: int | None, iops: int | None) -> None:
        """Throttle the reads of ``cgroup``'s processes to ``mbps`` MB/s and ``iops`` reads a second on every device
        (None: unlimited)."""
        if self._set.get(cgroup) == (mbps, iops):
            return
        bps = mbps * MB if mbps is not None else None
        for dev in self.devices:
            if self.version == 1:  # one rule per write; 0 removes it
                _write(cgroup / "blkio.throttle.read_bps_device", f"{dev} {bps or 0}")
                _write(cgroup / "blkio.throttle.read_iops_device", f"{dev} {iops or 0}")
            else:
                _write(cgroup / "io.max", f"{dev} rbps={bps or 'max'} riops={iops or 'max'}")
        self._set[cgroup] = (mbps, iops)

    def forget(self, key: str) -> None:
        """The cgroup of ``key`` is gone: a new one of that name starts unlimited."""
        self._set.pop(self.root / key, None)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def bound_paths(config: SandboxPoolConfig) -> list[str]:
    """What the zygotes of a pool of ``config`` bind (see ``Zygote``): the host's top directories, the interpreter's,
    ``ro_paths``, the bytecode cache and, for programs, the packages of this interpreter's environment (its
    site-packages directories, which hold them: resolving the packages themselves took 0.6 s of the loop)."""
    from prime_orchestrator.sandbox.programs import pool_python
    from prime_orchestrator.sandbox.zygotes import interpreter_dirs

    python = config.python or os.path.realpath(sys.executable)
    site = sysconfig.get_paths()
    programs = [site["purelib"], site["platlib"]] if config.program_packages and pool_python(config.python) else []
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prime"
    return [*TOPS, *interpreter_dirs(python), *config.ro_paths, str(cache), *programs]


def pool_limits(
    cgroups: Cgroups, devices: list[str], hidden: list[str], config: SandboxPoolConfig, unenforced: list[str]
) -> DiskLimits | None:
    """The pool's :class:`DiskLimits` (its total written on v2), or None; what goes unthrottled is added to
    ``unenforced`` (a filesystem hiding its disk, no blkio or io cgroup, v1's lack of a total)."""
    what = "disk reads of executions"
    if hidden:
        unenforced.append(f"{what} from {'; '.join(hidden)}")
    if not devices:
        return None
    io = cgroups.io_dir()
    if io is None:
        unenforced.append(f"{what} (no blkio cgroup hierarchy, or the io controller not delegated to the pool)")
        return None
    disk = DiskLimits(devices, cgroups.version, io)
    total = (config.total_disk_read_mbps, config.total_disk_read_iops)
    try:  # v1: checks the devices take limits, on the pool's cgroup, which no process is in (v1 is flat)
        disk.apply(io, *(total if cgroups.version == 2 else (1, 1)))
        if cgroups.version == 1:
            disk.apply(io, None, None)
    except OSError as e:
        unenforced.append(f"{what} ({io}: {e.strerror} for devices {' '.join(devices)})")
        return None
    if cgroups.version == 1 and total != (None, None):
        unenforced.append(
            "disk reads of all the pool's executions together (total_disk_read_mbps): cgroup v1 throttles each "
            "execution's cgroup alone"
        )
    return disk
