"""math-verify in a child process, so that scoring a reply has a bound.

sympy's parse and arithmetic have no bound: parsing a 60 kB sum (``1+1+...``) takes over 10 s, and a boxed
``2^{2^{40}}`` or ``(10^{6})!``, were it ever evaluated, is big-integer arithmetic in C that runs for minutes to forever
(``score_answer`` now refuses those as not numbers before evaluating them). No signal interrupts either
(math-verify's own timeouts are SIGALRM, which also needs the main thread). In the env worker
that call would block the event loop of every rollout it serves. Here one child per worker process scores the
replies, one at a time; a reply it has not scored within ``SCORE_TIMEOUT_S`` scores 0 and the child is killed (and
started again for the next reply). The child dies with its parent and may not take more than ``MEMORY_BYTES``.

Run as ``python -m arithmetic.verify``: JSON ``[reply, answer]`` lines in, one score per line out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys

from arithmetic.data import plain_integer_score

SCORE_TIMEOUT_S = 10.0
"""Most seconds one reply may take (a right answer takes milliseconds; the margin is for a loaded host)."""
START_TIMEOUT_S = 120.0
"""Most seconds the child may take to import math-verify and score a warm-up reply."""
MEMORY_BYTES = 2 << 30
"""Address-space limit of the child: a value too big to hold fails fast with MemoryError (a wrong answer)."""
_LINE_LIMIT = 1 << 24

logger = logging.getLogger("arithmetic.verify")


class Scorer:
    """The scoring child of this process: ``await score(reply, answer)`` in [0, 1], within ``timeout_s``."""

    def __init__(self, timeout_s: float = SCORE_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    async def score(self, reply: str, answer: str) -> float:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a child and lock belong to one event loop
            self.close()
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            proc = await self._child()
            try:
                proc.stdin.write(json.dumps([reply, answer]).encode() + b"\n")
                async with asyncio.timeout(self.timeout_s):
                    await proc.stdin.drain()
                    line = await proc.stdout.readline()
                return float(line)
            except TimeoutError:
                logger.warning("math-verify took over %.0f s on a reply; scored 0, restarting it", self.timeout_s)
            except (ValueError, OSError):  # the child died (e.g. killed for memory) before it answered
                logger.warning("math-verify exited on a reply; scored 0, restarting it")
            except BaseException:  # cancelled mid-reply: the child's next line would answer this reply
                self.close()
                raise
            self.close()
            return 0.0

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "arithmetic.verify",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
        )
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await self._proc.stdout.readline()
        except TimeoutError:
            self.close()
            raise RuntimeError(f"the math-verify child did not start within {START_TIMEOUT_S:.0f} s") from None
        except BaseException:
            self.close()
            raise
        if ready.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the math-verify child did not start (it said {ready[:200]!r})")
        return self._proc

    def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        self._proc = None


_scorer: Scorer | None = None


async def bounded_score(reply: str, answer: str) -> float:
    """``score_answer`` of this process's scoring child: 0 for a reply it cannot score within its bound.

    A boxed plain integer is scored here: the child scores one reply at a time, so behind replies that each take
    the whole bound (a power tower: ``SCORE_TIMEOUT_S`` and a restart of the child) every right answer of the
    worker waited its turn."""
    plain = plain_integer_score(reply, answer)
    if plain is not None:
        return plain
    global _scorer
    if _scorer is None:
        _scorer = Scorer()
    return await _scorer.score(reply, answer)


def _die_with_parent() -> None:
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(0)


def main() -> None:
    import resource

    from arithmetic.data import score_answer

    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    score_answer("\\boxed{1}", "1")  # the first call loads latex2sympy's grammar: not inside a reply's bound
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply, answer = json.loads(line)
            value = score_answer(str(reply), str(answer))
        except (ValueError, TypeError, MemoryError, RecursionError):
            value = 0.0
        out.write(f"{value}\n")
        out.flush()


if __name__ == "__main__":
    main()
