"""The code tasks, without verifiers: a deterministic generator of functions to write with hidden unit tests,
and the extraction of the code from a reply."""

from __future__ import annotations

import collections
import copy
import itertools
import json
import random
import re

from code_tasks.families import FAMILIES, Family

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Answer with one ```python code block that defines the requested "
    "function (standard library only, no input() or printing needed)."
)
_DRAWS_PER_TEST = 20  # random inputs drawn for the hidden tests, per test: enough to find distinct values
_BLOCK_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _reference(family: Family, name: str, params: dict):
    source = family.source.format(name=name, **params)
    namespace: dict = {}
    exec(compile(source, f"<reference {family.key}>", "exec"), namespace)  # our own code, never the model's
    return source, namespace[name]


def _cases(family: Family, params: dict, fn, rng: random.Random, n: int) -> list[tuple[str, object]]:
    """``n`` distinct (call expression, expected value) pairs: the family's edge cases, then random inputs. The
    prompt shows the last ones; this draw (and what it takes from ``rng``) must not change, or every prompt after
    it would, and the shipped SFT model and its data with them."""
    name = fn.__name__
    seen, cases = set(), []
    candidates = list(family.edge_cases) + [family.inputs(rng, params) for _ in range(8 * n)]
    for args in candidates:
        expr = f"{name}({', '.join(repr(a) for a in args)})"
        if expr in seen:
            continue
        seen.add(expr)
        cases.append((expr, fn(*copy.deepcopy(args))))
        if len(cases) == n:
            break
    return cases


def _blind_keys(args: tuple, value) -> tuple[str, ...]:
    """What a function that ignores the task could answer and pass this test with: the value itself (a constant),
    and the first argument when the value equals it (echoing the input)."""
    canon = json.dumps(value, sort_keys=True, default=repr)
    echo = args and canon == json.dumps(args[0], sort_keys=True, default=repr)
    return ("=" + canon, "echo") if echo else ("=" + canon,)


def _calls(family: Family, params: dict, fn, rng: random.Random, num_draws: int, shown: set[str]):
    """(call expression, expected value, blind keys) of the family's edge cases, then of ``num_draws`` random
    inputs, each call once and none of those ``shown``."""
    seen = set(shown)
    for args in itertools.chain(family.edge_cases, (family.inputs(rng, params) for _ in range(num_draws))):
        expr = f"{fn.__name__}({', '.join(repr(a) for a in args)})"
        if expr not in seen:
            seen.add(expr)
            value = fn(*copy.deepcopy(args))
            yield expr, value, _blind_keys(args, value)


def _hidden(family: Family, params: dict, fn, rng: random.Random, n: int, shown: set[str]) -> list[tuple[str, object]]:
    """``n`` calls to test, none of them shown: the family's edge cases, then random inputs, such that no expected
    value (and no echo of the argument) repeats while the family has other values to test. The edge cases' values
    are common constants (0, [], None), and always testing two of them paid a stub returning the family's most
    frequent value a third of the reward; now a constant passes one test of ``n``, or ``ceil(n / k)`` in a family
    with only ``k`` values (True/False)."""
    pool: list[tuple[str, object, tuple[str, ...]]] = []
    chosen, taken = {}, collections.Counter()
    for call in _calls(family, params, fn, rng, _DRAWS_PER_TEST * n, shown):
        pool.append(call)
        if not any(taken[key] for key in call[2]):
            chosen[len(pool) - 1] = call[:2]
            taken.update(call[2])
            if len(chosen) == n:
                break
    if len(chosen) < n:
        # Fewer distinct values than tests (True/False): each repeats as evenly as it can, and which one repeats
        # most is drawn, not always the edge cases' value.
        rank = {call[2][0]: rng.random() for call in pool}
        order = sorted(range(len(pool)), key=lambda i: (rank[pool[i][2][0]], i))
        for cap in range(2, n + 1):
            for index in order:
                if len(chosen) < n and index not in chosen and all(taken[key] < cap for key in pool[index][2]):
                    chosen[index] = pool[index][:2]
                    taken.update(pool[index][2])
    return [chosen[i] for i in sorted(chosen)]


def _prompt(family: Family, name: str, params: dict, examples: list[tuple[str, object]]) -> str:
    shown = "\n".join(f">>> {expr}\n{expected!r}" for expr, expected in examples)
    return (
        f"Write a Python function `{family.signature.format(name=name)}`.\n\n"
        f"{family.doc.format(**params)}\n\nExamples:\n{shown}\n\n"
        "Reply with the complete function in a ```python code block."
    )


def generate_tasks(
    n: int, seed: int = 0, num_tests: int = 5, num_examples: int = 2, families: list[str] | None = None
) -> list[dict]:
    """``n`` tasks ``{"id", "family", "prompt", "system_prompt", "tests", "reference"}``, deterministic in
    ``seed``. ``tests`` are ``{"expr", "expected"}`` (hidden from the model: the prompt shows ``num_examples``
    other calls); ``reference`` solves the task (for SFT data and tests). ``families`` (keys) restricts the draw;
    None draws from all of them."""
    pool = FAMILIES
    if families is not None:
        unknown = sorted(set(families) - {f.key for f in FAMILIES})
        if unknown or not families:
            raise ValueError(f"unknown or no families {unknown}; known: {[f.key for f in FAMILIES]}")
        pool = tuple(f for f in FAMILIES if f.key in families)
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        family = pool[rng.randrange(len(pool))]
        params = family.params(rng)
        name = family.key
        source, fn = _reference(family, name, params)
        examples = _cases(family, params, fn, rng, num_tests + num_examples)[-num_examples:]
        # The hidden tests come from a stream of their own, so that choosing them leaves the prompts as they were.
        tests_rng = random.Random(f"{seed}:{i}:tests")
        hidden = _hidden(family, params, fn, tests_rng, num_tests, {expr for expr, _ in examples})
        tasks.append(
            {
                "id": f"{seed}-{i}-{family.key}",
                "family": family.key,
                "prompt": _prompt(family, name, params, examples),
                "system_prompt": SYSTEM_PROMPT,
                "tests": [{"expr": e, "expected": v} for e, v in hidden],
                "reference": source,
            }
        )
    return tasks


def extract_code(reply: str) -> str:
    """The last fenced code block of ``reply`` (preferring one that defines a function); the bare reply if it has
    no fence but defines a function; else ''."""
    blocks = _BLOCK_RE.findall(reply or "")
    with_def = [b for b in blocks if "def " in b]
    if with_def or blocks:
        return (with_def or blocks)[-1]
    return reply if reply and "def " in reply else ""
