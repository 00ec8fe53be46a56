"""Where a blocked env process is stuck, for the one line that names why it was replaced.

Each env process (the server and every worker) registers ``faulthandler`` on ``SIGUSR1`` to write its threads'
Python stacks to ``<progress dir>/env_stack_<pid>.txt``. faulthandler dumps from C, so it answers while the event loop
is blocked in a reward function or tool call that never returns (``time.sleep``, a big-integer power in sympy). Before
``HangWatch`` kills a silent process it asks for that dump and names the function the loop is stuck in, and the
env's own function that called it (the first frame outside verifiers' machinery).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import faulthandler
import os
import re
import signal
from pathlib import Path

from prime_core.progress import PROGRESS_DIR_VAR

DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT_S = 1.0
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
_LOOP_FRAMES = ("_run_once", "run_forever", "run_until_complete")
_file = None  # faulthandler writes to this file's descriptor for the process's life


def stack_file(pid: int) -> Path | None:
    """The stack file of env process ``pid`` (None outside a run: no progress dir)."""
    directory = os.environ.get(PROGRESS_DIR_VAR)
    return Path(directory) / f"env_stack_{pid}.txt" if directory else None


def register_stack_dump() -> None:
    """In an env process: dump every thread's stack to its stack file on ``DUMP_SIGNAL``."""
    global _file
    path = stack_file(os.getpid())
    if path is None or _file is not None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _file = open(path, "w")  # noqa: SIM115 - held open: faulthandler keeps its descriptor
    faulthandler.register(DUMP_SIGNAL, file=_file, all_threads=True)
    atexit.register(_remove, path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


async def blocked_in(pid: int) -> str | None:
    """Ask process ``pid`` for its stacks; ``f (file:line)`` its event loop is stuck in (``, called from g (...)``
    for the env's own function below it), or None when it registered no dump or wrote none in time."""
    path = stack_file(pid)
    if path is None or not path.exists():
        return None
    try:
        size = path.stat().st_size
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return None
    text, before = "", None
    for _ in range(int(DUMP_WAIT_S / 0.05)):  # faulthandler writes the whole dump at once: wait until it stops growing
        await asyncio.sleep(0.05)
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")[size:]
        if text and text == before:
            break
        before = text
    _remove(path)  # the process is killed next; its file goes with it
    return summarize(text)


def summarize(dump: str) -> str | None:
    """The innermost frame of the thread that runs the event loop, and the env's frame that led there."""
    frames = _loop_thread(dump)
    if not frames:
        return None
    where = _frame(frames[0])
    for inner, outer in zip(frames, frames[1:], strict=False):  # most recent first
        if _in_verifiers(outer["path"]) and not _in_verifiers(inner["path"]):
            if inner is not frames[0]:
                where += f", called from {_frame(inner)}"
            break
    return where


def _loop_thread(dump: str) -> list[dict[str, str]]:
    """Frames (innermost first) of the dumped thread whose stack holds the asyncio loop."""
    threads: list[list[dict[str, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(m.groupdict())
    return next((t for t in threads if any(f["name"] in _LOOP_FRAMES for f in t)), [])


def _frame(frame: dict[str, str]) -> str:
    parts = Path(frame["path"]).parts
    return f"{frame['name']} ({'/'.join(parts[-2:])}:{frame['line']})"


def _in_verifiers(path: str) -> bool:
    return f"{os.sep}verifiers{os.sep}" in path or f"{os.sep}asyncio{os.sep}" in path
