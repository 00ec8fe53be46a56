"""multiprocessing's temporary directory (the forkserver's socket), owned so that one left by a killed process goes.

multiprocessing makes ``$TMPDIR/pymp-*`` on first use and only an exit handler removes it: a process SIGKILLed (or
stopped by SIGTERM before ``env_server``'s handler) left it behind. Under ``rl`` and SLURM jobs every process has a
private TMPDIR that the launcher removes (``prime_launch.process``); an orchestrator or ``eval`` started by hand has
none, so its ``pymp-*`` directory holds a lock file (`LOCK`) locked while the process lives, and the next such
process removes every one whose lock is free (one without the file is not ours and stays). A lock, not a pid: a
process of another pid namespace (a container sharing ``/tmp``) is alive whatever this one's ``/proc`` says. The
name stays as short as multiprocessing's own: the forkserver's socket path has at most 107 bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import shutil
import tempfile
from multiprocessing import util
from pathlib import Path

PREFIX = "pymp-"
LOCK = ".prime-owner.lock"


def own_temp_dir() -> str:
    """This process's multiprocessing temp dir, made now (unless multiprocessing made one already) after removing
    those of processes that are gone."""
    config = mp.current_process()._config
    if config.get("tempdir"):
        return config["tempdir"]
    base = Path(tempfile.gettempdir())
    remove_orphans(base)
    # Locked under another name, then renamed: a sweeper never sees the directory before its lock is held.
    making = Path(tempfile.mkdtemp(prefix=f".{PREFIX}", dir=base))
    fd = os.open(making / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held until the process ends (the descriptor is never closed)
    tempdir = str(base / making.name.removeprefix("."))
    os.rename(making, tempdir)
    # What multiprocessing.util.get_temp_dir would register: removed at a normal exit.
    util.Finalize(None, util._remove_temp_dir, args=(shutil.rmtree, tempdir), exitpriority=-100)
    config["tempdir"] = tempdir
    return tempdir


def remove_orphans(base: Path) -> list[Path]:
    """Remove the ``pymp-*`` directories under ``base`` that this module made and whose owner is gone (its lock is
    free); returns them."""
    removed = []
    for path in base.glob(f"{PREFIX}*"):
        try:
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # being made, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
