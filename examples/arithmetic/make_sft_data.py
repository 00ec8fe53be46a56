"""Write the arithmetic SFT data (messages format) from the environment's own generator.

    uv run python examples/arithmetic/make_sft_data.py --num-examples 20000 --seed 1234 --max-operand 10 \
        --tagged-fraction 0.4

The seed differs from the ones the RL environment draws its prompts with (0 for training, 4242 for the held-out
eval), so SFT and RL draw different problems (with operands up to 10 the same problem recurs by chance).

Each answer writes the equation first, then the result (``2+6=\\boxed{8}``): a scratchpad that turns the problem
into copying two numbers and a local sum, which a 1.6M-parameter model learns in a few hundred SFT steps.

A fraction of the results is written as ``<answer>N</answer>``, the convention of other datasets (this repository's
tool-use and color-shapes environments use it), instead of the ``\\boxed{N}`` the arithmetic environment asks for.
math-verify reads no number from ``2+6=<answer>8</answer>``, so the SFT model answers in a style that scores 0 that
often when it samples: headroom RL closes (examples/arithmetic/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from arithmetic import generate_examples

_OPS = {"finds": "+", "Monday": "+", "gives away": "-", "boxes": "*"}


def equation(prompt: str, answer: str) -> str:
    """``a<op>b=`` of a generated problem: its two numbers and the operation its template names."""
    op = next(symbol for word, symbol in _OPS.items() if word in prompt)
    a, b = (word for word in prompt.replace(".", " ").replace("?", " ").split() if word.isdigit())
    return f"{a}{op}{b}="


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-operand", type=int, default=10, help="the environment's max_operand")
    parser.add_argument("--tagged-fraction", type=float, default=0.4, help="answers as <answer>N</answer>")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for ex in generate_examples(args.num_examples, seed=args.seed, max_operand=args.max_operand):
            tagged = style.random() < args.tagged_fraction
            answer = f"<answer>{ex['answer']}</answer>" if tagged else ex["completion"]
            messages = [
                {"role": "system", "content": ex["system_prompt"]},
                {"role": "user", "content": ex["prompt"]},
                {"role": "assistant", "content": equation(ex["prompt"], ex["answer"]) + answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
