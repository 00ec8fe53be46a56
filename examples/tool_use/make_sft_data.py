"""Write the tool-use SFT data (messages with tool calls) from the environment's own generator.

    uv run python examples/tool_use/make_sft_data.py --num-examples 20000 --seed 1234 --direct-fraction 0.4

The seed differs from the ones the RL environment draws its problems with (0 for training, 4242 for the held-out
eval). A conversation that uses the tool is the system prompt, the question, a call of ``calculator_evaluate`` on
the question's expression, the tool's result and ``<answer>result</answer>`` (right-aligned in 12 characters, as
the template shows the result: make_base.py): two copies over a fixed distance, which a 1.6M-parameter model learns
in a few hundred steps. A ``--direct-fraction`` of the conversations answer at once, without the tool,
with a two-digit estimate in words (``1234 * 5678`` -> ``About 7000000.``), as a model doing mental arithmetic
would: no ``<answer>`` tag, so the SFT model scores 0 that often when it samples, and RL closes the gap by calling
the tool every time (examples/tool_use/README.md). The estimate stays out of ``<answer>``: after that tag the model
has only one thing to learn, copying the tool's result.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tool_use import SYSTEM_PROMPT, generate_examples

TOOL_NAME = "calculator_evaluate"  # the environment's CalculatorToolset.evaluate, as verifiers names it
RESULT_WIDTH = 12  # the model's template right-aligns tool results in 12 characters (make_base.py)


def estimate(value: int) -> int:
    """``value`` rounded to two significant digits."""
    digits = len(str(abs(value)))
    return round(value, -(digits - 2)) if digits > 2 else value


def conversation(ex: dict, direct: bool) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ex["prompt"]}]
    if direct:
        return messages + [{"role": "assistant", "content": f"About {estimate(int(ex['answer']))}."}]
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": ex["expression"]}}}
    return messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": ex["answer"]},
        {"role": "assistant", "content": f"<answer>{ex['answer']:>{RESULT_WIDTH}}</answer>"},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--digits", type=int, default=4, help="the environment's digits")
    parser.add_argument("--terms", type=int, default=2, help="the environment's terms")
    parser.add_argument("--direct-fraction", type=float, default=0.4, help="answers without calling the tool")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for ex in generate_examples(args.num_examples, seed=args.seed, digits=args.digits, terms=args.terms):
            f.write(json.dumps({"messages": conversation(ex, style.random() < args.direct_fraction)}) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
