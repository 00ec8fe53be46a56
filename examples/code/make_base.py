"""Build the code example's base model directory: the reverse-text base (Qwen3 config, character-level tokenizer)
with a single token for a 4-space indent and 1,024 positions.

    uv run python examples/code/make_base.py --out examples/code/base

The character-level vocabulary already holds every printable ASCII character, so Python needs no new tokens; the
indent token only shortens solutions (a fifth to a third of their characters are indentation). A prompt with the
system prompt is 400 to 520 characters in the four families the CPU example trains on (up to 1,100 in all
fourteen: fizzbuzz shows lists of up to 40 strings) and a solution up to 170 tokens, past the reverse-text model's
512 positions. Deterministic: re-running writes identical files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prime_models.tiny import extend_base

ROOT = Path(__file__).resolve().parents[2]
REVERSE_TEXT_BASE = ROOT / "examples" / "reverse_text" / "base"
INDENT = "    "
MAX_POSITIONS = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    args = parser.parse_args()
    vocab = extend_base(REVERSE_TEXT_BASE, args.out, [INDENT], max_positions=MAX_POSITIONS)
    print(f"wrote {args.out}: vocabulary {vocab}, {MAX_POSITIONS} positions")


if __name__ == "__main__":
    main()
