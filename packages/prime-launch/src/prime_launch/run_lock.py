"""One launch per output directory: ``rl`` holds an exclusive ``flock`` on ``<output-dir>/.rl.lock`` from before it
checks the directory until it exits.

Without it a second launch on the directory of a running one deleted that run's files (``--overwrite``, or a plain
launch before the first step, which takes them for a failed start's leftovers), rewound them (``--resume``) or wrote
its configs over them (``--dry-run``), while the running processes went on writing there. The lock is the kernel's: it
goes with the launcher however that ends (a kill -9 included), so a stale file never blocks a directory. The file
stays (removing it would let a third launch lock a new file while the second still holds the old one); it holds the
holder's pid and host for the refusal's message.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

LOCK_NAME = ".rl.lock"


class DirectoryInUse(FileExistsError):
    """The output directory is held by another launch; the message is one line."""


def lock_output_dir(root: Path) -> IO[str] | None:
    """Lock ``root`` (created if missing) for this launch; the open lock file, held until closed or this process ends.
    ``DirectoryInUse`` naming the holder when another launch holds it; None where the file system has no ``flock``
    (the launch goes on unguarded)."""
    root.mkdir(parents=True, exist_ok=True)
    # Held past this call; opened close-on-exec, so the children never hold it.
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
