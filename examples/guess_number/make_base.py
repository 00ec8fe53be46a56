"""Build the guess-number example's base model directory: the reverse-text base (Qwen3 config, character-level
tokenizer, plain ChatML template) with ``<guess>`` and ``</guess>`` as single tokens.

    uv run python examples/guess_number/make_base.py --out examples/guess_number/base

Single tokens for the tags leave the model one thing to learn per turn, the number; spelled out character by
character the tags cost a 1.6M-parameter model most of its SFT steps. Deterministic: re-running writes identical
files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
REVERSE_TEXT_BASE = ROOT / "examples" / "reverse_text" / "base"
GUESS_TOKENS = ["<guess>", "</guess>"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(REVERSE_TEXT_BASE)
    tokenizer.add_tokens(GUESS_TOKENS)
    tokenizer.save_pretrained(args.out)
    config = json.loads((REVERSE_TEXT_BASE / "config.json").read_text())
    config["vocab_size"] = len(tokenizer)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(REVERSE_TEXT_BASE / "generation_config.json", args.out / "generation_config.json")
    print(f"wrote {args.out}: vocabulary {len(tokenizer)}")


if __name__ == "__main__":
    main()
