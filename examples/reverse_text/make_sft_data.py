"""Write the reverse-text SFT data (messages format) from the environment's own generator.

    uv run python examples/reverse_text/make_sft_data.py --num-examples 6000 --seed 1234 --untagged-fraction 0.4

The seed differs from the ones the RL environment draws its prompts with, so SFT and RL prompts differ.

A fraction of the answers is written without the ``<reversed>`` tags, as a second data source with its own
answer style would have it. The environment only accepts tagged answers, so the SFT model answers in the wrong
style that often when it samples: the headroom RL is there to close (examples/reverse_text/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from reverse_text.data import generate_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--untagged-fraction", type=float, default=0.4, help="answers without the <reversed> tags")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for ex in generate_examples(args.num_examples, seed=args.seed):
            untagged = style.random() < args.untagged_fraction
            messages = [
                {"role": "system", "content": ex["system_prompt"]},
                {"role": "user", "content": ex["prompt"]},
                {"role": "assistant", "content": ex["answer"] if untagged else ex["completion"]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
