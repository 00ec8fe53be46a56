"""Problem generator, the calculator's evaluator and answer parsing (no verifiers import)."""

from __future__ import annotations

import ast
import operator
import random
import re

SYSTEM_PROMPT = (
    "You have a calculator tool. Call it to compute the result, then give the final number inside <answer></answer>."
)

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_ABS = 10**30
_ANSWER = re.compile(r"<answer>\s*(-?\d[\d,]*)\s*</answer>")
_MAX_CHARS = 2000


def generate_examples(n: int, seed: int = 0, digits: int = 4, terms: int = 2) -> list[dict]:
    """``n`` problems ``{"prompt", "expression", "answer"}`` over ``terms`` integers of ``digits`` digits."""
    if digits < 1 or terms < 2:
        raise ValueError(f"need digits >= 1 and terms >= 2, got digits={digits}, terms={terms}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    out = []
    for _ in range(n):
        numbers = [rng.randint(lo, hi) for _ in range(terms)]
        ops = [rng.choice("+-*") for _ in range(terms - 1)]
        expression = str(numbers[0]) + "".join(f" {op} {x}" for op, x in zip(ops, numbers[1:], strict=True))
        out.append({"prompt": f"What is {expression}?", "expression": expression, "answer": str(evaluate(expression))})
    return out


def evaluate(expression: str) -> int:
    """Integer value of an arithmetic ``expression`` (+ - * // %, parentheses, unary minus); ValueError otherwise."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"expression too long ({len(expression)} characters, at most {_MAX_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _eval(tree.body)
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression[:200]!r}") from e
    except (RecursionError, MemoryError) as e:  # `1+1+...+1` or `----1` nests deeper than Python recurses
        raise ValueError("expression nested too deeply") from e


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
        # Bounded so a model cannot make the tool server compute huge products.
        if abs(value) > _MAX_ABS:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported element {type(node).__name__}: use integers with + - * // % and parentheses")


def parse_answer(reply: str) -> int | None:
    """The integer in the last ``<answer>...</answer>`` of ``reply`` (thousands commas allowed), or None."""
    found = _ANSWER.findall(reply or "")
    try:
        return int(found[-1].replace(",", "")) if found else None
    except ValueError:  # more digits than Python converts (4300): no answer, not a failed rollout
        return None
