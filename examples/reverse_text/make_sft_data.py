"""Write the reverse-text SFT data (messages format) from the environment's own generator.

    uv run python examples/reverse_text/make_sft_data.py --num-examples 6000 --seed 1234

The seed differs from the ones the RL environment draws its prompts with, so SFT and RL prompts differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reverse_text.data import generate_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for ex in generate_examples(args.num_examples, seed=args.seed):
            messages = [
                {"role": "system", "content": ex["system_prompt"]},
                {"role": "user", "content": ex["prompt"]},
                {"role": "assistant", "content": ex["completion"]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
