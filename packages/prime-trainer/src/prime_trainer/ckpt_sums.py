"""CRC-32 of every checkpoint file, taken from the bytes on their way to ``write()``: a save reads nothing back.

DCP's ``FileSystemWriter`` opens every file it writes (data shards, ``.metadata``) through its ``fs.create_stream``;
``CrcFileSystemWriter`` swaps in a file system whose streams sum what passes through them. A stream that is seeked,
truncated or short-written cannot vouch for its file: that file's CRC is left unknown and read back from disk instead
(`prime_core.io.file_crc32`), as every file was before.

A CRC of the bytes handed to ``write()`` is not a read-back check of the disk: a disk that stores other bytes is not
caught at save. That is the right trade: the checksums exist for resume, which CRCs every file on disk before
anything loads, so a bad write is caught there, one line naming the file, exactly as strictly as a read back at save
would have done; reading back at save would only move that discovery earlier, at the cost of rereading every shard
on every rank at every save (seconds to minutes for a large model, on the training's critical path).
"""

from __future__ import annotations

import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

# A write at least this long is summed on a helper thread while the file takes it (both release the GIL): the CRC
# costs about as much as the copy into the page cache, and side by side it adds next to nothing to the save.
_OVERLAP_BYTES = 1 << 20


class _CrcStream:
    """A binary output stream that sums the bytes it writes; anything but appending makes its sum unknown."""

    def __init__(self, raw: Any):
        self._raw = raw
        self.crc: int | None = 0
        self._helper: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        if self.crc is None:
            return self._raw.write(data)
        view = memoryview(data).cast("B")  # its length in bytes; a file takes contiguous buffers only anyway
        if view.nbytes < _OVERLAP_BYTES:
            written = self._raw.write(data)
            crc = zlib.crc32(view, self.crc)
        else:
            self._helper = self._helper or ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")
            summing = self._helper.submit(zlib.crc32, view, self.crc)
            try:
                written = self._raw.write(data)
            finally:  # the caller may free the buffer once write returns, so the sum must be done by then
                crc = summing.result()
        # Buffered files take every byte or raise; a count short of it would leave the sum ahead of the file.
        self.crc = crc if written == view.nbytes else None
        return written

    def close_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()

    def seek(self, *args: Any) -> int:
        self.crc = None
        return self._raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.crc = None
        return self._raw.truncate(*args)

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (fsync), close, ...
        return getattr(self._raw, name)


class _CrcFileSystem(FileSystem):
    def __init__(self) -> None:
        self.sums: dict[Path, str | None] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _CrcStream(raw)
            try:
                yield stream
            finally:
                stream.close_helper()
        self.sums[Path(path)] = None if stream.crc is None else f"{stream.crc:08x}"

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)  # DCP writes .metadata under a temporary name
        self.sums[Path(new_path)] = self.sums.pop(Path(path), None)


class CrcFileSystemWriter(FileSystemWriter):
    """DCP's file system writer, unchanged but for summing what it writes (``checksums``)."""

    def __init__(self, path: str | Path, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _CrcFileSystem()

    def checksums(self) -> dict[str, str | None]:
        """CRC-32 per file this rank wrote, by name under the checkpoint directory (``None``: unknown, read it back)."""
        root = Path(self.path)
        return {str(p.relative_to(root)): crc for p, crc in self.fs.sums.items() if p.is_relative_to(root)}
