"""The code tasks, without verifiers: a deterministic generator of functions to write with hidden unit tests,
and the extraction of the code from a reply."""

from __future__ import annotations

import copy
import random
import re

from code_tasks.families import FAMILIES, Family

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Answer with one ```python code block that defines the requested "
    "function (standard library only, no input() or printing needed)."
)
_BLOCK_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _reference(family: Family, name: str, params: dict):
    source = family.source.format(name=name, **params)
    namespace: dict = {}
    exec(compile(source, f"<reference {family.key}>", "exec"), namespace)  # our own code, never the model's
    return source, namespace[name]


def _cases(family: Family, params: dict, fn, rng: random.Random, n: int) -> list[tuple[str, object]]:
    """``n`` distinct (call expression, expected value) pairs: the family's edge cases, then random inputs."""
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
        cases = _cases(family, params, fn, rng, num_tests + num_examples)
        examples, hidden = cases[-num_examples:], cases[: len(cases) - num_examples]
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
