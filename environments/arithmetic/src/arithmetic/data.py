"""Word-problem generator and math-verify scoring (no verifiers import)."""

from __future__ import annotations

import random
import re

SYSTEM_PROMPT = "Solve the problem. Put the final number in \\boxed{}."

NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles"]

_TEMPLATES = (
    ("+", "{n} has {a} {item}. {n} finds {b} more. How many {item} does {n} have now?"),
    ("-", "{n} has {a} {item} and gives away {b}. How many {item} are left?"),
    ("*", "{n} buys {a} boxes with {b} {item} each. How many {item} is that?"),
    ("+", "{n} read {a} pages on Monday and {b} pages on Tuesday. How many pages in total?"),
)


def generate_examples(
    n: int, seed: int = 0, max_operand: int = 20, hard_fraction: float = 0.0, hard_max_operand: int = 100
) -> list[dict[str, str]]:
    """``n`` problems ``{"prompt", "answer", "completion", "system_prompt"}``, deterministic in ``seed``; a share
    ``hard_fraction`` of them (drawn per problem) takes operands up to ``hard_max_operand`` instead."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # Without hard problems no extra draw is taken: the problems of a seed stay those of earlier versions.
        top = hard_max_operand if hard_fraction > 0 and rng.random() < hard_fraction else max_operand
        op, template = rng.choice(_TEMPLATES)
        a, b = rng.randint(1, top), rng.randint(1, top)
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = template.format(n=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
        out.append(
            {
                "prompt": prompt,
                "answer": str(value),
                "completion": f"\\boxed{{{value}}}",
                "system_prompt": SYSTEM_PROMPT,
            }
        )
    return out


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INTEGER = re.compile(r"\s*[+-]?[0-9]{1,100}\s*", re.ASCII)


def plain_integer_score(reply: str, answer: str) -> float | None:
    """``score_answer(reply, answer)`` without sympy when the reply's last ``\\boxed{}`` and ``answer`` are both plain
    integers (as every right answer is), else None (sympy has to say)."""
    boxed = _BOXED.findall(reply)
    if not boxed or not _INTEGER.fullmatch(boxed[-1]) or not _INTEGER.fullmatch(answer):
        return None
    return 1.0 if int(boxed[-1]) == int(answer) else 0.0


def score_answer(reply: str, answer: str) -> float:
    """1.0 when math-verify finds the reply's answer to be a number equal to ``answer``, else 0.0.

    A number, not an expression: sympy evaluates what it parses, so ``\\boxed{12 \\times 17}`` (the problem's operands
    copied, no arithmetic done) would match 204; copying the operands and the operator scored 1.0 on every problem.

    Unbounded: sympy parses a long reply for seconds (a 60 kB sum: over 10 s). The environment scores through
    ``arithmetic.verify.bounded_score``, which runs this in a child process it kills at a time limit."""
    import logging

    from math_verify import parse, verify

    # math-verify's timeouts are off: they need SIGALRM (the main thread) and cannot interrupt big-integer C code.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    boxed = _BOXED.findall(reply)
    candidate = f"${boxed[-1]}$" if boxed else reply
    try:
        gold = parse(f"${answer}$", parsing_timeout=None)
        pred = parse(candidate, parsing_timeout=None)
        if not pred or not getattr(pred[0], "is_Number", False):  # 12*17, sqrt(64), a set, an equation
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
    except Exception:  # math-verify raises on malformed LaTeX; that is a wrong answer
        return 0.0
