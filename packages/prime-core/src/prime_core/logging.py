"""Per-process logging: a console handler plus ``<output-dir>/logs/<process>.log``."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname).1s [{process}] %(message)s"


class _LogFile(logging.FileHandler):
    """``logs/<process>.log``. A disk that refuses a line (full, read-only, failing) is said once, in one line on
    stderr, and the file stops there (the console keeps every line), instead of a traceback on every line after."""

    _refused = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._refused:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        from prime_core.io import StorageError, storage_error, storage_error_line

        found = storage_error(sys.exc_info()[1]) if sys.exc_info()[1] is not None else None
        if found is None:
            return super().handleError(record)
        self._refused = True
        stream, self.stream = self.stream, None  # its buffer would fail again at every flush and at close
        with contextlib.suppress(OSError):
            stream.close()
        error = StorageError(found.errno, found.strerror or "", self.baseFilename)
        error.what = "the log"
        print(f"{storage_error_line(error)}; later log lines go to the console only", file=sys.stderr, flush=True)


class _Console(logging.StreamHandler):
    """The console: whatever ``sys.stdout`` is when a line is logged. A handler holding the stream it was made with
    wrote into a closed file once the program replaced ``sys.stdout`` (an entry point's ``main`` called in-process:
    a notebook's cell, pytest's capture), and every later line of the process was a "Logging error" traceback."""

    @property
    def stream(self):  # noqa: ANN201 (a text stream)
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 (StreamHandler.__init__ sets it)
        pass


def setup_logging(process: str, *, level: str = "info", log_file: str | Path | None = None) -> logging.Logger:
    """Configure the root logger once for this process and return the ``prime.<process>`` logger.

    When launched by ``rl``, stdout is already teed into the log file; pass ``log_file=None`` then to avoid
    writing every line twice.
    """
    fmt = logging.Formatter(_FORMAT.format(process=process), datefmt="%H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_prime", False):
            root.removeHandler(handler)
    console = _Console()
    console.setFormatter(fmt)
    console._prime = True  # type: ignore[attr-defined]
    root.addHandler(console)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = _LogFile(log_file)
        file_handler.setFormatter(fmt)
        file_handler._prime = True  # type: ignore[attr-defined]
        root.addHandler(file_handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"prime.{process}")
