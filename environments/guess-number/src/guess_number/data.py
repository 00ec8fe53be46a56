"""Guess-number game logic (no verifiers import)."""

from __future__ import annotations

import random
import re

SYSTEM_PROMPT = (
    "Guess the secret integer between 1 and {high}. Reply with one guess per turn as <guess>N</guess>; "
    "you are told whether the secret is higher or lower."
)

_GUESS_RE = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


def generate_examples(n: int, seed: int = 0, high: int = 16) -> list[dict]:
    """``n`` games ``{"prompt", "secret", "high", "system_prompt"}``, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [
        {
            "prompt": f"Find the number between 1 and {high}.",
            "secret": rng.randint(1, high),
            "high": high,
            "system_prompt": SYSTEM_PROMPT.format(high=high),
        }
        for _ in range(n)
    ]


def parse_guess(reply: str) -> int | None:
    """The number in the last ``<guess>N</guess>`` of ``reply``, or None without one."""
    found = _GUESS_RE.findall(reply or "")
    try:
        return int(found[-1]) if found else None
    except ValueError:  # more digits than Python converts (4300): no guess, not a crashed game
        return None


def feedback(guess: int | None, secret: int) -> str:
    """What the game answers: ``correct``, ``higher``, ``lower``, or a reminder of the format."""
    if guess is None:
        return "No guess found: reply with <guess>N</guess>."
    if guess == secret:
        return "correct"
    return "higher" if secret > guess else "lower"


def game_reward(solved: bool, num_guesses: int, max_guesses: int) -> float:
    """1 for a first-try hit, decreasing linearly to 0.5 at max_guesses; 0 when unsolved."""
    if not solved:
        return 0.0
    return 1.0 - 0.5 * (num_guesses - 1) / max(1, max_guesses - 1)
