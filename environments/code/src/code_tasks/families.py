"""Families of functions to write. Each is a reference implementation (source with a ``{name}`` placeholder, run
only on the host to compute expected values), a description, parameters drawn per task, and an input sampler.

Parameters change the function itself (a divisor, a shift, a word list), so two tasks of one family differ
in what the code must do, not only in their tests.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    key: str
    params: Callable[[random.Random], dict[str, Any]]
    """Draw the task's parameters."""
    signature: str
    """``name(arguments)`` template."""
    doc: str
    """What the function must do (a format string over the parameters)."""
    source: str
    """Reference implementation (format string over ``name`` and the parameters)."""
    inputs: Callable[[random.Random, dict[str, Any]], tuple]
    """One argument tuple."""
    edge_cases: tuple[tuple, ...] = ()
    """Argument tuples always tested (literal values)."""


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n_max: int = 10) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, n_max))]


def _word(rng: random.Random, lo: int = 1, hi: int = 7) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _text(rng: random.Random, n_max: int = 6) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(0, n_max)))


FAMILIES: tuple[Family, ...] = (
    Family(
        "sum_divisible",
        lambda r: {"k": r.randint(2, 7)},
        "{name}(nums)",
        "Return the sum of the integers in the list `nums` that are divisible by {k} (0 for none).",
        "def {name}(nums):\n    return sum(x for x in nums if x % {k} == 0)\n",
        lambda r, p: (_ints(r),),
        (([],), ([0, 14, -21, 7, 6],)),
    ),
    Family(
        "shift_letters",
        lambda r: {"k": r.randint(1, 25)},
        "{name}(text)",
        "Shift every lowercase ASCII letter of `text` forward by {k} places in the alphabet, wrapping from z to a; "
        "leave every other character unchanged. Return the new string.",
        "def {name}(text):\n"
        "    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in text)\n",
        lambda r, p: (_text(r) + r.choice(["", "!", " 42", "Z"]),),
        (("",), ("xyz abc",)),
    ),
    Family(
        "count_chars",
        lambda r: {"chars": "".join(sorted(r.sample(string.ascii_lowercase, r.randint(2, 5))))},
        "{name}(text)",
        "Return how many characters of `text` are one of the letters '{chars}' (lowercase only).",
        "def {name}(text):\n    return sum(c in '{chars}' for c in text)\n",
        lambda r, p: (_text(r, 8),),
        (("",),),
    ),
    Family(
        "fizzbuzz",
        lambda r: {
            "a": r.randint(2, 5),
            "b": r.randint(6, 9),
            "wa": r.choice(["Fizz", "Foo", "Ping"]),
            "wb": r.choice(["Buzz", "Bar", "Pong"]),
        },
        "{name}(n)",
        "Return a list of strings for the numbers 1..n: '{wa}{wb}' for multiples of both {a} and {b}, '{wa}' for "
        "multiples of {a}, '{wb}' for multiples of {b}, and the number itself (as a string) otherwise.",
        "def {name}(n):\n"
        "    out = []\n"
        "    for i in range(1, n + 1):\n"
        "        s = ('{wa}' if i % {a} == 0 else '') + ('{wb}' if i % {b} == 0 else '')\n"
        "        out.append(s or str(i))\n"
        "    return out\n",
        lambda r, p: (r.randint(0, 40),),
        ((0,), (90,)),
    ),
    Family(
        "max_window",
        lambda r: {"w": r.randint(2, 4)},
        "{name}(nums)",
        "Return the largest sum of {w} consecutive elements of the list `nums`, or None if it has fewer than {w} "
        "elements.",
        "def {name}(nums):\n"
        "    if len(nums) < {w}:\n"
        "        return None\n"
        "    return max(sum(nums[i:i + {w}]) for i in range(len(nums) - {w} + 1))\n",
        lambda r, p: (_ints(r, n_max=12),),
        (([],), ([-5, -1, -3, -4, -2],)),
    ),
    Family(
        "run_length",
        lambda r: {"sep": r.choice(["", ":", "-"])},
        "{name}(text)",
        "Run-length encode `text`: each maximal run of one character becomes the character, then '{sep}', then the "
        "run's length (e.g. 'aab' gives 'a{sep}2b{sep}1'). Return '' for ''.",
        "def {name}(text):\n"
        "    out, i = [], 0\n"
        "    while i < len(text):\n"
        "        j = i\n"
        "        while j < len(text) and text[j] == text[i]:\n"
        "            j += 1\n"
        "        out.append(text[i] + '{sep}' + str(j - i))\n"
        "        i = j\n"
        "    return ''.join(out)\n",
        lambda r, p: ("".join(r.choice("aab") * r.randint(1, 4) for _ in range(r.randint(0, 5))),),
        (("",), ("zzzzzzzzzzzz",)),
    ),
    Family(
        "nth_largest",
        lambda r: {"n": r.randint(2, 3)},
        "{name}(nums)",
        "Return the {n}-th largest distinct value in the list `nums` (1st is the maximum), or None if there are "
        "fewer than {n} distinct values.",
        "def {name}(nums):\n    vals = sorted(set(nums), reverse=True)\n    return vals[{n} - 1] if len(vals) >= {n} else None\n",
        lambda r, p: (_ints(r, -5, 5),),
        (([],), ([7, 7, 7],)),
    ),
    Family(
        "rotate",
        lambda r: {"direction": r.choice(["left", "right"])},
        "{name}(items, k)",
        "Return a new list: `items` rotated {direction} by `k` positions (k >= 0 may exceed the length; an empty "
        "list stays empty).",
        "def {name}(items, k):\n"
        "    if not items:\n"
        "        return []\n"
        "    k %= len(items)\n"
        "    k = k if '{direction}' == 'left' else (len(items) - k) % len(items)\n"
        "    return items[k:] + items[:k]\n",
        lambda r, p: (_ints(r, 0, 9, 8), r.randint(0, 12)),
        (([], 3), ([1, 2, 3], 3)),
    ),
    Family(
        "histogram",
        lambda r: {"min_count": r.randint(1, 2)},
        "{name}(words)",
        "Given a list of words, return a dict mapping each word that occurs at least {min_count} time(s) to its "
        "number of occurrences.",
        "def {name}(words):\n"
        "    counts = {{}}\n"
        "    for w in words:\n"
        "        counts[w] = counts.get(w, 0) + 1\n"
        "    return {{w: c for w, c in counts.items() if c >= {min_count}}}\n",
        lambda r, p: ([r.choice(["red", "blue", "green", "sun", "moon"]) for _ in range(r.randint(0, 8))],),
        (([],),),
    ),
    Family(
        "primes",
        lambda r: {"kind": r.choice(["count", "sum"])},
        "{name}(n)",
        "Return the {kind} of the prime numbers strictly below the integer `n` (0 when there are none).",
        "def {name}(n):\n"
        "    ps = [p for p in range(2, max(n, 2)) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n"
        "    return len(ps) if '{kind}' == 'count' else sum(ps)\n",
        lambda r, p: (r.randint(-3, 200),),
        ((0,), (2,), (3,)),
    ),
    Family(
        "balanced",
        lambda r: {"pairs": r.choice(["()[]", "(){}", "()[]{}", "<>()"])},
        "{name}(text)",
        "Return True if the brackets in `text` are balanced and properly nested, considering only the pairs in "
        "'{pairs}' (each pair is an opening then a closing character); every other character is ignored.",
        "def {name}(text):\n"
        "    pairs = '{pairs}'\n"
        "    closing = {{pairs[i + 1]: pairs[i] for i in range(0, len(pairs), 2)}}\n"
        "    stack = []\n"
        "    for c in text:\n"
        "        if c in pairs[::2]:\n"
        "            stack.append(c)\n"
        "        elif c in closing:\n"
        "            if not stack or stack.pop() != closing[c]:\n"
        "                return False\n"
        "    return not stack\n",
        lambda r, p: ("".join(r.choice(p["pairs"] + "ab") for _ in range(r.randint(0, 10))),),
        (("",), ("a",)),
    ),
    Family(
        "digit_power",
        lambda r: {"power": r.randint(1, 3)},
        "{name}(n)",
        "Return the sum of the decimal digits of the integer `n` (ignore its sign), each raised to the power {power}.",
        "def {name}(n):\n    return sum(int(d) ** {power} for d in str(abs(n)))\n",
        lambda r, p: (r.randint(-(10**6), 10**6),),
        ((0,), (-9,)),
    ),
    Family(
        "common_prefix",
        lambda r: {"case": r.choice(["sensitive", "insensitive"])},
        "{name}(words)",
        "Return the longest common prefix of the strings in the list `words` ('' for an empty list), comparing "
        "case-{case}ly; return the prefix as it appears in the first word.",
        "def {name}(words):\n"
        "    if not words:\n"
        "        return ''\n"
        "    norm = [w.lower() if '{case}' == 'insensitive' else w for w in words]\n"
        "    n = 0\n"
        "    while all(n < len(w) for w in norm) and len({{w[n] for w in norm}}) == 1:\n"
        "        n += 1\n"
        "    return words[0][:n]\n",
        lambda r, p: ([r.choice(["Pre", "pre", "pa"]) + _word(r, 0, 3) for _ in range(r.randint(1, 4))],),
        (([],), (["same", "same"],)),
    ),
    Family(
        "transpose_sum",
        lambda r: {"axis": r.choice(["row", "column"])},
        "{name}(matrix)",
        "Given a rectangular matrix as a list of rows (lists of integers, at least one row and one column), return "
        "the list of its {axis} sums.",
        "def {name}(matrix):\n"
        "    rows = matrix if '{axis}' == 'row' else [list(c) for c in zip(*matrix)]\n"
        "    return [sum(r) for r in rows]\n",
        lambda r, p: (
            [[r.randint(-9, 9) for _ in range(c)] for c in [r.randint(1, 4)] for _ in range(r.randint(1, 4))],
        ),
        (([[5]],),),
    ),
)
