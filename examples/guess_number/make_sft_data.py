"""Write the guess-number SFT data: whole games (multi-turn ``messages``) played against the environment's own
secrets and feedback.

    uv run python examples/guess_number/make_sft_data.py --num-examples 20000 --seed 1234 --random-fraction 0.4

The seed differs from the ones the RL environment draws its secrets with (0 for training, 4242 for the held-out
eval). Most games are played by binary search: guess the middle of the range the answers so far leave, which finds
any secret in [1, 15] within 4 guesses. A ``--random-fraction`` of the games guess uniformly in [1, high] every turn
and ignore the answers, as a model that knows the format but not the game would. The SFT model then plays both ways
when it samples (its first guess is the middle about 60% of the time), greedy decoding follows the binary search,
and RL at temperature 1.0 has the difference to close (examples/guess_number/README.md).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from guess_number import SYSTEM_PROMPT, feedback, generate_examples


def play(secret: int, high: int, max_guesses: int, rng: random.Random | None) -> list[int]:
    """The guesses of one game: binary search when ``rng`` is None, else uniform guesses that ignore the answers."""
    low, top, guesses = 1, high, []
    while len(guesses) < max_guesses:
        guess = (low + top) // 2 if rng is None else rng.randint(1, high)
        guesses.append(guess)
        if guess == secret:
            break
        low, top = (guess + 1, top) if secret > guess else (low, guess - 1)
    return guesses


def conversation(ex: dict, guesses: list[int]) -> list[dict]:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT.format(high=ex["high"])},
        {"role": "user", "content": ex["prompt"]},
    ]
    for i, guess in enumerate(guesses):
        if i:  # the environment answers every guess but the last one
            messages.append({"role": "user", "content": feedback(guesses[i - 1], ex["secret"])})
        messages.append({"role": "assistant", "content": f"<guess>{guess}</guess>"})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "sft.jsonl")
    parser.add_argument("--num-examples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--high", type=int, default=15, help="the environment's high")
    parser.add_argument("--max-guesses", type=int, default=4, help="the environment's max_guesses")
    parser.add_argument("--random-fraction", type=float, default=0.4, help="games that guess at random")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    style = random.Random(f"{args.seed}:style")
    with open(args.out, "w") as f:
        for ex in generate_examples(args.num_examples, seed=args.seed, high=args.high):
            rng = style if style.random() < args.random_fraction else None
            guesses = play(ex["secret"], args.high, args.max_guesses, rng)
            f.write(json.dumps({"messages": conversation(ex, guesses)}) + "\n")
    print(f"wrote {args.num_examples} games to {args.out}")


if __name__ == "__main__":
    main()
