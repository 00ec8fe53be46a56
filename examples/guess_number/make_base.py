"""Build the guess-number example's base model directory: the reverse-text base (Qwen3 config, character-level
tokenizer, plain ChatML template) with ``<guess>`` and ``</guess>`` as single tokens.

    uv run python examples/guess_number/make_base.py --out examples/guess_number/base

Single tokens for the tags leave the model one thing to learn per turn, the number; spelled out character by
character the tags cost a 1.6M-parameter model most of its SFT steps. Deterministic: re-running writes identical
files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prime_models.tiny import extend_base

ROOT = Path(__file__).resolve().parents[2]
REVERSE_TEXT_BASE = ROOT / "examples" / "reverse_text" / "base"
GUESS_TOKENS = ["<guess>", "</guess>"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    args = parser.parse_args()
    vocab = extend_base(REVERSE_TEXT_BASE, args.out, GUESS_TOKENS)
    print(f"wrote {args.out}: vocabulary {vocab}")


if __name__ == "__main__":
    main()
