"""Write the color-shapes SFT data (messages rows with the image inline) from the environment's own generator.

    uv run python examples/color_shapes/make_sft_data.py --num-examples 20000 --seed 1234 --untagged-fraction 0.35

The seed differs from the ones the RL environment draws its scenes with (0 for training, 4242 for the held-out
eval). Every answer is the right one for its picture, so all of the data teaches the model to look. Most answers are
in the environment's format, ``<answer>red</answer>``; an ``--untagged-fraction`` say it in a sentence,
``The answer is red.``, which the scorer gives 0. The SFT model samples that style about as often, and RL at
temperature 1.0 moves it to the tag (examples/color_shapes/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from color_shapes import sft_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--image-size", type=int, default=32, help="the environment's image_size")
    parser.add_argument("--untagged-fraction", type=float, default=0.35, help="answers outside <answer></answer>")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for row in sft_rows(args.num_examples, args.seed, image_size=args.image_size):
            reply = row["messages"][-1]
            if style.random() < args.untagged_fraction:
                answer = reply["content"].removeprefix("<answer>").removesuffix("</answer>")
                reply["content"] = f"The answer is {answer}."
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.num_examples} examples to {args.out}")


if __name__ == "__main__":
    main()
