"""Atomic file hand-off between processes.

Every file one process hands to another is written under a temporary name in the same directory and
renamed into place, so readers either see nothing or the complete file. Directories are published by
writing a ``STABLE`` marker last.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STABLE_MARKER = "STABLE"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """``fsync=False`` for files rewritten every second (heartbeats): the rename alone keeps readers from seeing a
    partial file; only a power loss could lose the last version."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", fsync=fsync)


@contextmanager
def atomic_dir(path: str | os.PathLike, *, stable: bool = True) -> Iterator[Path]:
    """Build a directory under a temporary name, rename it onto ``path``, then write the STABLE marker.

    An existing directory at ``path`` is replaced. Readers wait for ``path/STABLE`` (see ``wait_stable``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists() or path.is_symlink():
            remove_published(path)
        os.replace(tmp, path)
        if stable:
            mark_stable(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_published(directory: str | os.PathLike) -> None:
    """Delete a directory published with a STABLE marker, the marker first: a stop part-way through (a kill, a
    full disk) never leaves a directory that says it is complete with files missing.

    A symlink there (planted by someone who can write to a shared run directory, or copied with a run) goes alone:
    what it points at is outside this run and is never touched (its marker was deleted through the link before)."""
    if Path(directory).is_symlink():
        Path(directory).unlink()
        return
    (Path(directory) / STABLE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def open_regular(path: str | os.PathLike, *, follow: bool = True):  # noqa: ANN201 (a binary file object)
    """Open a regular file for reading; ``OSError`` for anything else at ``path``. A watcher that read a FIFO left where a
    process's file goes (a heartbeat, a log) waited in ``open`` for a writer that never came, and a device never ends:
    the watchdog itself hung, and nothing was watched any more.

    Checked before opening too: opening a device runs its driver's open (a terminal, a watchdog timer). O_NOCTTY: a
    link to a terminal opened by a session leader without one (every process rl starts) made it that process's
    controlling terminal, and the terminal's hang-up then killed the process with SIGHUP. ``follow=False``: a symlink
    at ``path`` itself is refused (``ELOOP``), also one swapped in between the check and the open."""
    if not stat.S_ISREG((os.stat if follow else os.lstat)(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def mark_stable(directory: str | os.PathLike) -> None:
    atomic_write_text(Path(directory) / STABLE_MARKER, f"{time.time()}\n")


def is_stable(directory: str | os.PathLike) -> bool:
    return (Path(directory) / STABLE_MARKER).is_file()


def wait_for_path(
    path: str | os.PathLike,
    *,
    timeout: float | None,
    poll_interval: float = 0.05,
    on_wait: Any = None,
    log_every: float = 30.0,
) -> Path:
    """Block until ``path`` exists. ``on_wait(elapsed)`` is called every ``log_every`` seconds.

    Raises ``TimeoutError`` naming the path after ``timeout`` seconds (``None`` waits forever).
    """
    path = Path(path)
    start = last_log = time.monotonic()
    while not path.exists():
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {path}")
        if on_wait is not None and now - last_log >= log_every:
            on_wait(now - start)
            last_log = now
        time.sleep(poll_interval)
    return path


def wait_stable(directory: str | os.PathLike, *, timeout: float | None, **kwargs: Any) -> Path:
    wait_for_path(Path(directory) / STABLE_MARKER, timeout=timeout, **kwargs)
    return Path(directory)


# Errors of the storage itself (full, over quota, read-only, failing): the user must free space or move the run.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def storage_error(exc: BaseException) -> OSError | None:
    """The storage ``OSError`` behind ``exc``: itself, its cause/context chain, or a failure of a torch
    distributed checkpoint (``CheckpointException.failures`` maps ranks to wrapped exceptions)."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):  # DCP wraps a rank's failure as (exception, traceback)
            todo.extend(x for x in e if isinstance(x, BaseException))
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        rust_io = re.search(r"\(os error (\d+)\)", str(e))  # safetensors reports Rust's io::Error as text
        if rust_io and int(rust_io.group(1)) in STORAGE_ERRNOS:
            return OSError(int(rust_io.group(1)), os.strerror(int(rust_io.group(1))))
        todo.extend([e.__cause__, e.__context__, *getattr(e, "failures", {}).values()])
    return None


def storage_error_line(e: OSError, path: str | os.PathLike | None = None) -> str:
    """``No space left on device (errno 28 ENOSPC) writing <file>`` (``writing checkpoint step 12 to <dir>`` from
    `writing`; ``writing under <path>`` when the error names no file): the cause and where, on one line."""
    code = errno.errorcode.get(e.errno or 0, "?")
    what = getattr(e, "what", None)
    if what:  # a `StorageError` of `writing`: what the run was writing, and where to
        where = f" writing {what} to {e.filename}"
    else:
        where = f" writing {e.filename}" if e.filename else f" writing under {path}" if path else ""
    return f"{e.strerror or os.strerror(e.errno or 0)} (errno {e.errno} {code}){where}"


class UnreadableFile(ValueError):
    """A file of the run that is there but cannot be read back (truncated, corrupted, another schema): its
    message is one line naming the file and what is wrong with it."""


def first_line(e: BaseException) -> str:
    """``Type: message`` of ``e`` on one line (a ``KeyError`` names its missing key)."""
    text = f"missing {e.args[0]!r}" if isinstance(e, KeyError) and e.args else (str(e).strip() or "(no message)")
    line = text.splitlines()[0]
    return f"{type(e).__name__}: {line if len(line) <= 200 else line[:200] + '...'}"


def one_line(message: str) -> str:
    """A failure's reason on one line: its first line and, when there are more, its last. A harness that crashed
    reports its stderr's tail, a traceback whose cause is the last line; the first alone named no cause (``harness
    'prime-chat' exited 1: Traceback (most recent call last):``, or a cut frame line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or ["(no message)"]
    return lines[0][:500] if len(lines) == 1 else f"{lines[0][:200]} ... {lines[-1][-300:]}"


class ExposedFile(UnreadableFile):
    """A private file (a secret) that users other than its owner can read."""


def read_regular(path: str | os.PathLike, what: str, limit: int | None = None, *, private: bool = False) -> bytes:
    """The bytes of the file ``what`` (``"a progress record"``) at ``path``, opened with `open_regular`: a FIFO there
    blocked the reader in ``open`` for good, and a link to a device fed it without end. Those, a socket, a directory,
    a loop of symlinks and a file over ``limit`` bytes (a small record the run wrote, replaced by something else) are
    an `UnreadableFile` naming the path; a missing file or a failing disk stays an ``OSError``.

    ``private`` (a secret): a symlink at ``path`` is refused and the mode is checked on the open descriptor, so what is
    read is what was checked; a file others can read is an `ExposedFile`. Checked by path first, then read, a file
    renamed or linked into place in between (one others can read or write) was read as the secret."""
    try:
        with open_regular(path, follow=not private) as f:
            st = os.fstat(f.fileno())
            if private and st.st_mode & 0o077:
                raise ExposedFile(f"{path} is readable by other users")
            # By its size first, before any of it is read (reading up to the limit took as much memory as the limit);
            # the bounded read still holds for a file that grows meanwhile (a /proc file says 0).
            data = b"" if limit is not None and st.st_size > limit else f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        # ENXIO: a socket (or a device without its driver), which open refuses; ELOOP: a loop of symlinks. Neither
        # is a failing disk, which the entry points would call it.
        if e.errno not in (errno.EINVAL, errno.EISDIR, errno.ENXIO, errno.ELOOP):
            raise
        raise UnreadableFile(f"{path}: not a regular file ({what} is one)") from None
    if limit is not None and max(len(data), st.st_size) > limit:
        raise UnreadableFile(f"{path}: over {limit} bytes, too large for {what}") from None
    return data


@contextmanager
def reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Parse ``path`` as ``what`` inside this block: a file cut short, corrupted or of another schema becomes an
    `UnreadableFile` naming it instead of the parser's traceback. A failing disk (``OSError``) stays itself: the
    entry points name it as a storage fault."""
    try:
        yield
    except (UnreadableFile, OSError):
        raise
    except Exception as e:
        if storage_error(e) is not None:
            raise
        raise UnreadableFile(f"{path}: unreadable {what} ({first_line(e)})") from e


# A model's small JSON files (config.json, generation_config.json, tokenizer_config.json, adapter_config.json, a
# preprocessor config): the largest real ones are around 1 MiB (a tokenizer config listing its added tokens).
SMALL_JSON_BYTES = 16 << 20
# A model's large JSON files (tokenizer.json, a sharded checkpoint's index): tens of MiB for the biggest vocabularies.
LARGE_JSON_BYTES = 256 << 20


def read_json(path: str | os.PathLike, what: str, limit: int = SMALL_JSON_BYTES) -> Any:
    """The JSON value of ``what`` (``"a model config"``) at ``path``, read by `read_regular` with ``limit``: a file
    of gigabytes under the name was read whole into memory, a FIFO blocked the reader for good. Those, and a file that
    is not JSON, are an `UnreadableFile` naming the path; a missing file or a failing disk stays an ``OSError``."""
    data = read_regular(path, what, limit)
    with reading(path, what):
        return json.loads(data)


class StorageError(OSError):
    """A write that failed for lack of storage; its message is one line naming the errno, what was being written
    (``what``, when known) and the path."""

    what: str | None = None

    def __str__(self) -> str:
        return storage_error_line(self)


def raise_storage_error(exc: BaseException, path: str | os.PathLike, what: str | None = None) -> None:
    """Re-raise ``exc`` as a `StorageError` if a storage error caused it (else return): naming ``what`` and ``path``
    when ``what`` is given, else the file the error names (or ``path``)."""
    found = storage_error(exc)
    if found is None and what is not None and not isinstance(exc, KeyboardInterrupt | SystemExit):
        found = _out_of_space(path)
    if found is None or isinstance(found, StorageError) and found.what:
        return  # not storage, or already named by an inner `writing`
    error = StorageError(
        found.errno, found.strerror or os.strerror(found.errno or 0), str(path) if what else found.filename or str(path)
    )
    error.what = what
    raise error from exc


def _out_of_space(path: str | os.PathLike) -> OSError | None:
    """ENOSPC when the file system of ``path`` has (almost) no space left: what a failed write there meant when
    the writer lost the errno (torch's zip writer says only ``unexpected pos 704 vs 598``)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize >= 1 << 20:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextmanager
def writing(what: str, path: str | os.PathLike) -> Iterator[None]:
    """Write ``what`` (``"checkpoint step 12"``) to ``path`` inside this block: a storage fault becomes a
    `StorageError` whose one line names both (``... writing checkpoint step 12 to <path>``)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise_storage_error(e, path, what)
        raise


def file_crc32(path: str | os.PathLike) -> str:
    """A file's CRC-32 as the checksum files hold it (8 hex digits: weights' ``checksums.json``, checkpoints' sums);
    only a regular file is opened (`open_regular`)."""
    crc = 0
    with open_regular(path) as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
