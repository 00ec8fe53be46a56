"""Run a Python solution and its test expressions inside the warm interpreter of a runner (untrusted side).

Each test is an expression evaluated in the solution's globals; its value goes back as JSON on the test channel,
one line per test, and the host compares it with the expected value, which never enters the sandbox (so a
solution cannot read it, and a forged line is worth nothing without the answer). Stdlib only.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import sys
import traceback


def _jsonable(value, depth: int = 0):
    if depth > 50:
        raise ValueError("value nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_jsonable(v, depth + 1) for v in value), key=repr)
    if isinstance(value, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    return repr(value)


def run(code: str, tests: list[str], test_fd: int) -> None:
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    channel = io.FileIO(test_fd, "w", closefd=False)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exit_code = 0
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the solution's frame down
        exit_code = 1
    for i, expr in enumerate(tests):
        try:
            line = {"i": i, "value": _jsonable(eval(compile(expr, f"test_{i}", "eval"), ns))}
        except BaseException as e:
            line = {"i": i, "error": f"{type(e).__name__}: {e}"[:500]}
        channel.write((json.dumps(line) + "\n").encode())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            exit_code = exit_code or 1
    os._exit(exit_code)
