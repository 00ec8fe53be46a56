"""Imported first by the env servers' forkserver (``env_server.PRELOAD``), before the seconds of importing the rest.

A terminal's Ctrl-C reaches the whole process group. The forkserver, still importing, printed a KeyboardInterrupt
traceback of 30 lines after which the orchestrator's server start failed with EOFError; it now ends at once, without a
word (the orchestrator's own line says what stopped). Once it serves, multiprocessing ignores SIGINT there itself.
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_quietly(signum: int, frame: object) -> None:
    os._exit(128 + signum)


# Only in a forkserver (``python -c 'from multiprocessing.forkserver import main; ...'``), never where it is imported
# by hand.
if sys.argv[:1] == ["-c"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_quietly)
