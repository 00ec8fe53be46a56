"""Write the code SFT data (messages format) from the code-tasks environment's own generator.

    uv run python examples/code/make_sft_data.py --num-examples 20000 --seed 1234 --table-fraction 0.35

The seed differs from the ones the RL environment draws its tasks with (0 for training, 4242 for the held-out
eval). The tasks come from the four families the CPU example trains on (rl.toml's ``families``): short
solutions with one parameter each, which a 1.6M-parameter model learns from a few hundred examples of each on a
shared 2-core CPU; all fourteen would need far more. Most replies are the task's reference solution in a ```python block: the family's code with the task's
parameters (a divisor, a shift, a word list) copied in from the prompt.

A ``--table-fraction`` of the replies hard-code the prompt's two example calls instead, a lookup table that
returns None for anything else:

    def rotate(items, k):
        if (items, k) == ([1, 2], 3):
            return [2, 1]
        ...
        return None

It is what a model that fits the visible examples rather than the description writes. The hidden tests never
repeat the shown calls, so such a reply scores 0 except where the answer happens to be None: the SFT model writes
a table that often when it samples, and RL has that to fix (examples/code/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from code_tasks import generate_tasks

FAMILIES = ["sum_divisible", "count_chars", "digit_power", "primes"]  # as in rl.toml

_SIGNATURE_RE = re.compile(r"`(\w+)\((.*?)\)`")
_EXAMPLE_RE = re.compile(r"^>>> \w+\((.*)\)\n(.*)$", re.MULTILINE)


def lookup_table(prompt: str) -> str:
    """A function that answers the prompt's example calls and nothing else."""
    name, params = _SIGNATURE_RE.search(prompt).groups()
    key = params if "," not in params else f"({params})"
    lines = [f"def {name}({params}):"]
    for call_args, expected in _EXAMPLE_RE.findall(prompt):
        value = call_args if "," not in params else f"({call_args})"
        lines += [f"    if {key} == {value}:", f"        return {expected}"]
    return "\n".join(lines + ["    return None", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-tests", type=int, default=5, help="the environment's num_tests")
    parser.add_argument("--families", nargs="+", default=FAMILIES, help="the environment's families")
    parser.add_argument("--table-fraction", type=float, default=0.35, help="replies that hard-code the examples")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for task in generate_tasks(args.num_examples, seed=args.seed, num_tests=args.num_tests, families=args.families):
            table = style.random() < args.table_fraction
            code = lookup_table(task["prompt"]) if table else task["reference"]
            messages = [
                {"role": "system", "content": task["system_prompt"]},
                {"role": "user", "content": task["prompt"]},
                {"role": "assistant", "content": f"```python\n{code}```"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
