"""Per-process logging: a console handler plus ``<output-dir>/logs/<process>.log``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname).1s [{process}] %(message)s"


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
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console._prime = True  # type: ignore[attr-defined]
    root.addHandler(console)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(fmt)
        file_handler._prime = True  # type: ignore[attr-defined]
        root.addHandler(file_handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"prime.{process}")
