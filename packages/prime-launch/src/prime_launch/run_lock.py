"""One launch per output directory, which stays where it is while the launch runs.

``rl`` holds an exclusive ``flock`` on ``<output-dir>/.rl.lock`` from before it
checks the directory until it exits.

Without it a second launch on the directory of a running one deleted that run's files (``--overwrite``, or a plain
launch before the first step, which takes them for a failed start's leftovers), rewound them (``--resume``) or wrote
its configs over them (``--dry-run``), while the running processes went on writing there. The lock is the kernel's: it
goes with the launcher however that ends (a kill -9 included), so a stale file never blocks a directory; the process
manager's watchdog shares it, so after a kill -9 it goes once the processes the watchdog stops are gone. The file
stays (removing it would let a third launch lock a new file while the second still holds the old one); it holds the
holder's pid and host for the refusal's message. ``OutputDirWatch`` stops a launch whose directory was deleted or
moved under it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from prime_launch.process import ProcessFailed

LOCK_NAME = ".rl.lock"


class DirectoryInUse(FileExistsError):
    """The output directory is held by another launch; the message is one line."""


def lock_output_dir(root: Path) -> IO[str] | None:
    """Lock ``root`` (created if missing) for this launch; the open lock file, held until closed or this process ends.
    ``DirectoryInUse`` naming the holder when another launch holds it; None where the file system has no ``flock``
    (the launch goes on unguarded)."""
    root.mkdir(parents=True, exist_ok=True)
    # Held past this call; opened close-on-exec, so the children never hold it.
    if (root / LOCK_NAME).exists() and not (root / LOCK_NAME).is_file():  # a FIFO: open said only "not seekable"
        raise FileExistsError(f"{root / LOCK_NAME} is not a regular file (rl's lock file is one): remove it")
    f = open(root / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f" ({holder})" if holder else ""
            raise DirectoryInUse(
                f"output directory {root} is in use by another rl launch{who}; wait for it to end or stop it "
                "(SIGTERM), or choose another --output-dir"
            ) from None
        return None  # ENOLCK, EINVAL, ENOSYS: a file system without flock
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


class OutputDirGone(ProcessFailed):
    """The run's output directory was deleted or moved under the running processes; ``cause`` is one line."""

    def __init__(self, line: str):
        super().__init__("output directory", None, Path("/dev/null"), reason=line)
        self.line = line

    @property
    def cause(self) -> str:
        return self.line

    def log_tail(self, num_lines: int = 30) -> str:
        return ""  # the logs went with the directory


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class OutputDirWatch:
    """The launch's output directories (and the main one's ``configs/``, which nothing removes while a run runs) stay
    the directories it started in. A deleted or moved one was not noticed: each process made the paths it writes
    again (progress files, a checkpoint in an empty skeleton) or failed at its next write, while the run's logs and
    files were gone or elsewhere; ``check`` raises ``OutputDirGone`` instead, so the launch stops at once."""

    def __init__(self, root: Path, others: Iterable[Path] = ()):
        paths = [root / "configs", *dict.fromkeys([root, *others])]
        self._known = {path: _identity(path) for path in paths}
        self._root = root

    def check(self) -> None:
        for path, known in self._known.items():
            if known is None or (now := _identity(path)) == known:
                continue
            where = path.parent if path.name == "configs" and path.parent == self._root else path
            what = f"its {path.name}/ is gone" if where != path else "it is gone" if now is None else "another is there"
            raise OutputDirGone(
                f"output directory {where} was deleted or moved while the run was running ({what}); stopped every "
                f"process: a moved directory resumes where it is now (rl --resume --output-dir <there>)"
            )
