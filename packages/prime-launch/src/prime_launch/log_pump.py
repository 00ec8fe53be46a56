"""A child's output into its log file, with a bound on the file's size.

Before, each child wrote straight into ``logs/<name>.log``, and so did everything it started: an environment's reward
that prints a megabyte per rollout, a tool, a library warning on every request. Over a run left alone for days that
filled the run's disk, and the run (and everything else on the disk) failed on it. Now the child writes into a pipe the
launcher reads: once the log reaches ``max_bytes`` it is moved to ``<name>.log.1`` (replacing the one before) and
starts again with a line saying so. A run's logs hold at most twice ``max_bytes`` per process, and the newest output,
which says why a process failed, is always kept.

A write the disk refuses (full, read-only) is said once, in one line on the launcher's stderr, and the child's output
is drained and dropped from then on: the child is never blocked on the disk's account (the run's end names the full
disk, `prime_launch.process.full_disk_note`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

from prime_core.io import storage_error, storage_error_line

CHUNK = 1 << 16


class LogPump:
    """Reads one child's output (the read end of its stdout/stderr pipe) and writes it to ``path``."""

    def __init__(self, read_fd: int, path: Path, max_bytes: int, *, append: bool = False):
        self.read_fd = read_fd
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        """Times the log was moved to ``<name>.log.1``."""
        self.refused: Exception | None = None
        """The disk's refusal that stopped the file (the output is drained and dropped since)."""
        self._file = open(path, "ab" if append else "wb", buffering=0)  # noqa: SIM115 (closed by the thread)
        self._size = self._file.seek(0, os.SEEK_END)
        self._thread = threading.Thread(target=self.drain, name=f"log {path.name}", daemon=True)

    def start(self) -> LogPump:
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the end of the output (every writer gone); True once it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drain(self) -> None:
        """Copy the output into the log until its end (every writer gone); ``start`` runs it in a thread."""
        try:
            while data := os.read(self.read_fd, CHUNK):
                if self.refused is None:
                    self._write(data)
        finally:
            os.close(self.read_fd)
            with contextlib.suppress(OSError):
                self._file.close()

    def _write(self, data: bytes) -> None:
        try:
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._size += len(data)
        except Exception as e:  # whatever it is, the pipe is still drained: a child must never block on its log
            self.refused = e
            found = storage_error(e)
            named = found and OSError(found.errno, found.strerror, str(self.path))  # a write's error names no file
            cause = storage_error_line(named) if named else f"{type(e).__name__}: {e} writing {self.path}"
            line = f"rl: {cause}; that process's later output is dropped"
            print(line, file=sys.stderr, flush=True)

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self.rotations += 1
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115
        stamp = time.strftime("%H:%M:%S")
        mib = self.max_bytes / (1 << 20)
        head = (
            f"{stamp} [rl] this log reached {mib:g} MiB ({self.rotations} times so far): the output before this line "
        )
        self._size = self._file.write(f"{head}is in {self.path.name}.1, older output is gone\n".encode())
