"""What crosses the sandbox boundary: an execution request, its test cases, and the result (also the HTTP body)."""

from __future__ import annotations

import math
from typing import Any, Literal

from prime_core.config.sandbox import SandboxLimits
from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "error", "timeout", "memory_limit", "output_limit", "sandbox_error"]


class TestCase(BaseModel):
    """One hidden unit test: an expression evaluated after the solution, and the value it must produce."""

    model_config = ConfigDict(extra="forbid")
    __test__ = False  # not a pytest class

    expr: str
    """Python expression evaluated in the solution's globals, e.g. ``add(2, 3)``."""
    expected: Any = None
    """Expected value (JSON-like: None, bool, int, float, str, lists, dicts). It never enters the sandbox."""


class ExecRequest(BaseModel):
    """One execution: Python source (with optional tests) or an argv, with stdin and limits."""

    model_config = ConfigDict(extra="forbid")

    code: str = ""
    """Python source run as ``__main__`` in a warm interpreter (ignored when ``argv`` is set)."""
    argv: list[str] | None = None
    """A program to execute instead (any language installed on the host's /usr), e.g. ``["sh", "-c", "..."]``."""
    stdin: str | None = None
    """Text on standard input (None: /dev/null)."""
    tests: list[TestCase] = Field(default_factory=list)
    """Test expressions, evaluated one by one after the solution (Python only)."""
    limits: SandboxLimits | None = None
    """Limits of this execution (None: the pool's defaults)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables (PATH, HOME=/work, TMPDIR=/work, LANG are set already)."""
    workspace: str | None = None
    """A workspace opened on the pool (persistent /work across executions); None: a fresh empty tmpfs."""


class TestOutcome(BaseModel):
    """How one test went."""

    __test__ = False

    passed: bool
    """Whether the value matched the expected one."""
    got: Any = None
    """The value the expression produced (JSON form; unrepresentable values as their repr)."""
    error: str | None = None
    """The exception the expression raised, or why no value came back."""


class ExecResult(BaseModel):
    """The outcome of an execution. A breached limit or escaped exception is a status, never a raise."""

    status: Status
    """``ok``; ``error`` (exception, non-zero exit, signal); ``timeout`` (wall or CPU); ``memory_limit``;
    ``output_limit``; ``sandbox_error`` (the sandbox itself failed: the code is not to blame)."""
    reason: str = ""
    """Why it did not end ``ok``, in one line."""
    exit_code: int | None = None
    """Exit status (negative: killed by that signal)."""
    stdout: str = ""
    """Standard output (at most the output limit)."""
    stderr: str = ""
    """Standard error (its tail, at most the output limit)."""
    tests: list[TestOutcome] = Field(default_factory=list)
    """One outcome per test case, in order."""
    wall_s: float = 0.0
    """Wall time of the execution inside the sandbox."""
    cpu_s: float = 0.0
    """CPU time (user + system) of the execution's processes."""
    max_rss_mb: float = 0.0
    """Peak resident memory of the largest process."""
    supervisor_cpu_s: float = 0.0
    """CPU time of the execution's trusted supervisor (sandbox overhead, for capacity planning)."""

    @property
    def num_passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def pass_fraction(self) -> float:
        """Fraction of tests passed (0.0 without tests)."""
        return self.num_passed / len(self.tests) if self.tests else 0.0


def values_match(got: Any, expected: Any) -> bool:
    """Equality on JSON-like values: tuples and lists alike, floats within 1e-6 (relative or absolute), and a
    bool never equal to an int."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, int | float) or not isinstance(expected, int | float):
            return False
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(expected, list | tuple):
        return (
            isinstance(got, list | tuple)
            and len(got) == len(expected)
            and all(values_match(g, e) for g, e in zip(got, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == {str(k) for k in expected}
            and all(values_match(got[str(k)], v) for k, v in expected.items())
        )
    return type(got) is type(expected) and got == expected


def judge(tests: list[TestCase], lines: list[dict]) -> list[TestOutcome]:
    """Outcomes of ``tests`` from the runner's test lines (the last line of each index wins)."""
    by_index: dict[int, dict] = {}
    for line in lines:
        if isinstance(line, dict) and isinstance(line.get("i"), int):
            by_index[line["i"]] = line
    outcomes = []
    for i, case in enumerate(tests):
        line = by_index.get(i)
        if line is None:
            outcomes.append(TestOutcome(passed=False, error="no result (the execution ended before this test)"))
        elif "error" in line:
            outcomes.append(TestOutcome(passed=False, error=str(line["error"])[:500]))
        else:
            got = line.get("value")
            outcomes.append(TestOutcome(passed=values_match(got, case.expected), got=got))
    return outcomes
