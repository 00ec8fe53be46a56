"""What crosses the sandbox boundary: an execution request, its test cases, the result (also the HTTP body), and
the pool's health counters; and how the host judges what the code wrote on its test channel."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from typing import Any, Literal

from prime_core.config.sandbox import SandboxLimits, SandboxPoolConfig
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
    rel_tol: float = Field(default=1e-6, ge=0, le=1)
    """Floats match when ``|got - expected| <= max(rel_tol * max(|got|, |expected|), abs_tol)`` (``math.isclose``)."""
    abs_tol: float = Field(default=1e-12, ge=0)
    """Absolute tolerance of float comparisons, for values near zero: small, so that an expected 4.2e-7 is not
    matched by 0.0; raise it for tasks whose answers are small differences of large numbers."""


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

    def oversized(self, c: SandboxPoolConfig) -> str:
        """Why the request is over the pool's size limits ('' when it is not): one line naming the field."""
        code = len(self.code.encode()) + sum(len(a.encode()) for a in self.argv or [])
        code += sum(len(k.encode()) + len(v.encode()) for k, v in self.env.items())
        stdin = len(self.stdin.encode()) if self.stdin is not None else 0
        tests = sum(len(t.expr.encode()) for t in self.tests)
        for what, size, cap, name in (
            ("code (with argv and env)", code, c.max_code_bytes, "max_code_bytes"),
            ("stdin", stdin, c.max_stdin_bytes, "max_stdin_bytes"),
            ("tests' expressions", tests, c.max_test_bytes, "max_test_bytes"),
        ):
            if size > cap:
                return f"{what} is {size} bytes, over the pool's limit of {cap} ({name})"
        if len(self.tests) > c.max_tests:
            return f"{len(self.tests)} tests, over the pool's limit of {c.max_tests} (max_tests)"
        return ""

    def not_text(self) -> str:
        """Why the request cannot be sent as UTF-8 ('' when it can): a lone surrogate in the code, argv, env, stdin
        or a test's expression; a NUL byte in argv or env, which no exec takes. A model can write one (``"\\ud800"`` in a tool call's JSON parses to it); it is the
        request's fault, a result like an over-size request, never an exception that would fail the rollout."""
        fields = {"code": [self.code], "argv": self.argv or [], "stdin": [self.stdin or ""]}
        fields["env"] = [*self.env, *self.env.values()]
        fields["tests' expressions"] = [t.expr for t in self.tests]
        for name, texts in fields.items():
            for text in texts:
                if "\0" in text and name in ("argv", "env"):  # a C string ends there: exec would refuse it unsaid
                    return f"{name} holds a NUL byte (at {text.index(chr(0))} of {text[:40]!a})"
                try:
                    text.encode()
                except UnicodeEncodeError as e:
                    return f"{name} is not valid text: {e.reason} ({text[e.start : e.end]!a} at {e.start})"
        return ""


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
    """Standard output (its start, at most the output limit; bytes that are not UTF-8 as U+FFFD). With stderr and the
    test channel, at most 1.5 times the output limit of JSON: cut further when escapes would make it more."""
    stderr: str = ""
    """Standard error (its tail, at most the output limit; cut like ``stdout``)."""
    tests: list[TestOutcome] = Field(default_factory=list)
    """One outcome per test case, in order."""
    wall_s: float = 0.0
    """Wall time of the execution inside the sandbox."""
    cpu_s: float = 0.0
    """CPU time (user + system) of the execution's processes."""
    max_rss_mb: float = 0.0
    """Peak resident memory of the largest process."""
    cpu_detected_s: float | None = None
    """The CPU time of the execution's processes together that its supervisor read when it found them past the CPU
    budget (then it killed them: ``timeout``, "... exceeded (all its processes)"); None otherwise, and where the pool
    has no cgroup CPU counter. ``cpu_s`` is what they spent until the kill took them, higher on a loaded host."""
    commands_killed: int = 0
    """A harness program's commands (its child processes) that its supervisor killed at the execution's memory or
    CPU limit in the program's place, which went on (see ``supervisor.Commands``)."""
    supervisor_cpu_s: float = 0.0
    """CPU time of the execution's trusted supervisor (sandbox overhead, for capacity planning)."""
    memory_peak_mb: float | None = None
    """Peak memory of the whole execution (every process, and its files in /work), from its cgroup; None where
    the pool has no memory cgroup (see ``SandboxHealth.unenforced``)."""

    @property
    def num_passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def pass_fraction(self) -> float:
        """Fraction of tests passed (0.0 without tests)."""
        return self.num_passed / len(self.tests) if self.tests else 0.0


class SandboxHealth(BaseModel):
    """A pool's counters (``SandboxPool.health()``, a node's ``GET /health``): cheap to read, for a launcher's
    progress check. Progress is ``executions_completed`` growing while ``running`` is above zero."""

    zygotes: int
    """Zygotes alive now."""
    zygotes_started: int
    """Zygotes started since the pool started (the first ones included)."""
    zygotes_replaced: int
    """Zygotes found dead, or killed because they forked nothing for ``hang_timeout_s`` with requests waiting."""
    executions_started: int
    """Executions handed to a zygote."""
    executions_completed: int
    """Executions that ended with a verdict of their supervisor (any status but ``sandbox_error``)."""
    sandbox_errors: int
    """Executions that ended as ``sandbox_error``."""
    running: int
    """Executions holding a slot now (running, waiting for a zygote, or being reaped)."""
    quarantined: int
    """Slots held back until every process of their ended execution is gone."""
    unenforced: list[str]
    """Limits this host does not let the pool enforce (logged at start)."""


MAX_DEPTH = 100  # nesting of a test value compared on the host; deeper values fail the test


def values_match(got: Any, expected: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-12, depth: int = 0) -> bool:
    """Equality on JSON-like values: tuples and lists alike, floats by ``math.isclose(rel_tol, abs_tol)``, and a
    bool never equal to an int. Values nested deeper than :data:`MAX_DEPTH` never match."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(got, int | float) or not isinstance(expected, int | float):
            return False
        return _numbers_close(got, expected, rel_tol, abs_tol)
    if isinstance(expected, list | tuple):
        return (
            isinstance(got, list | tuple)
            and len(got) == len(expected)
            and all(values_match(g, e, rel_tol, abs_tol, depth + 1) for g, e in zip(got, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == {str(k) for k in expected}
            and all(values_match(got[str(k)], v, rel_tol, abs_tol, depth + 1) for k, v in expected.items())
        )
    return type(got) is type(expected) and got == expected


def _numbers_close(got: int | float, expected: int | float, rel_tol: float, abs_tol: float) -> bool:
    try:
        return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    except OverflowError:
        # An int past a float's range (the code returned 10**400 where a float was expected, or the task expects
        # a huge int and the code returned a float): isclose cannot convert it. Compare exactly instead; the
        # other side is then finite, or inf/nan that no int is close to. Raising here would make the execution an
        # exception in the caller: a failed rollout instead of a zero reward.
        if any(isinstance(x, float) and not math.isfinite(x) for x in (got, expected)):
            return False
        g, e = Fraction(got), Fraction(expected)
        return abs(g - e) <= max(Fraction(rel_tol) * max(abs(g), abs(e)), Fraction(abs_tol))


# A string, to its closing quote or to the end: every quote that starts one consumes it, so a text of unclosed
# strings (a quote, then escaped quotes, then a lone backslash) costs one pass, not one per quote.
_STRINGS = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


def _nesting_pattern(limit: int) -> re.Pattern:
    """Brackets that pair up and nest at most ``limit`` deep: a regular language, matched in one pass (possessive
    quantifiers: no backtracking)."""
    pattern = b""
    for _ in range(limit):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)


_NESTED = _nesting_pattern(MAX_DEPTH + 1)


def _nested_within(raw: str) -> bool:
    """Whether the brackets of the JSON text ``raw`` pair up and nest at most ``MAX_DEPTH + 1`` deep (its strings'
    brackets aside), at C speed: a walk of the parsed value cost a Python step per element, and one line of 1.5 MB
    of ``[],`` (500,000 elements) held the pool's loop, which every neighbour's verdict waits on, for 0.6 to 2 s."""
    if raw.count("[") + raw.count("{") <= MAX_DEPTH + 1:
        return True
    # Outside its strings JSON is ASCII: what else is there is no bracket (and no JSON).
    brackets = _STRINGS.sub("", raw).encode("ascii", "ignore").translate(_SQUARE, _NOT_BRACKETS)
    return _NESTED.fullmatch(brackets) is not None


def longest_line(tests: list[TestCase]) -> int:
    """The longest test line that can be worth parsing for ``tests``: one holding a value that matches an expected
    one, or the harness's error (500 characters, at most 12 bytes of JSON each). A matching value is written as
    long as its expected value, but for floats: a float (at most 24 characters) matches a shorter one or an int
    (``0``, ``1e-13``), at most 12 times the expected value's JSON with its separators. A longer line fails its test
    unparsed: 1.5 MB of ``[],`` on one line cost the pool's loop, which every neighbour's verdict waits on, 0.25 s
    of json.loads on the 2-core VM, where the task expected ``[1, 2]``."""
    return max((12 * _json_length(t.expected) for t in tests), default=0) + 8192


def _json_length(value: Any) -> int:
    try:
        return len(json.dumps(value, default=repr))
    except (ValueError, RecursionError):  # an int past the digits str() allows, or nesting json cannot write
        return 1 << 40


def parse_test_lines(text: str, num_tests: int, max_line: int | None = None) -> list[dict]:
    """The runner's test lines that can decide ``num_tests`` tests, in the order written: a line that does not
    parse, is not an object, or nests too deeply is dropped (its test then fails), never an error of the sandbox.

    The last line of each index wins, and the harness writes its own after the code ran, so the channel is read
    from its end until every test has a line, and no further than ``4 * num_tests + 64`` lines: the code may
    write a megabyte of small lines, which took the pool's loop 0.2 s to parse (every neighbour waited), and a
    line before those the harness wrote last can never win. A line longer than ``max_line`` (see
    :func:`longest_line`) is dropped unparsed."""
    lines: list[dict] = []
    decided: set[int] = set()
    for raw in reversed(text.splitlines()[-(4 * num_tests + 64) :]):
        if len(decided) == num_tests:
            break
        if (max_line is not None and len(raw) > max_line) or not _nested_within(raw):
            continue  # unparsed: json.loads of a long line, or of a deep one, is costly
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(line, dict):
            lines.append(line)
            if isinstance(line.get("i"), int) and 0 <= line["i"] < num_tests:
                decided.add(line["i"])
    return lines[::-1]


def _text_only(value: Any) -> Any:
    """``value`` with each lone surrogate (``"\\ud800"`` parses to one) replaced by U+FFFD. Such a string is not
    text: a result holding it cannot be encoded as UTF-8, and a sandbox node answering with it failed (HTTP 500, a
    ``sandbox_error`` for the client) instead of failing the test. Only the values kept are checked: the code may
    write a megabyte of lines, of which one per test counts."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode()
        return value
    except UnicodeEncodeError:
        return json.loads(text.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))


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
            outcomes.append(TestOutcome(passed=False, error=_text_only(str(line["error"])[:500])))
        else:
            got = line.get("value")
            passed = values_match(got, case.expected, case.rel_tol, case.abs_tol)
            outcomes.append(TestOutcome(passed=passed, got=_text_only(got)))
    return outcomes
