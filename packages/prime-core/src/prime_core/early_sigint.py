"""Ctrl-C of an entry point before it has anything to stop (parsing, imports): one line and exit 130 at once.

Only the standard library here: the entry points import it first, before the seconds of importing pydantic, torch or
verifiers during which the Ctrl-C comes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def ends_on_sigint(line: str) -> Iterator[None]:
    """While an entry point parses and imports (nothing to stop yet), Ctrl-C prints ``line`` and ends the process
    at once, exit 130. A ``KeyboardInterrupt`` there was a traceback from wherever the import was, or (raised inside a
    class body's ``__set_name__``) a RuntimeError. SIGINT ignored (``nohup``) stays ignored; off the main thread, or
    with a handler someone else installed, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        print(line, file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
