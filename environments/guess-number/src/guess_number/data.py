"""Guess-number game logic (no verifiers import)."""

from __future__ import annotations

import json
import random
import re

SYSTEM_PROMPT = (
    "Guess the secret integer between 1 and {high}. Call the guess tool once per turn:\n"
    '<tool_call>{{"name": "guess", "arguments": {{"number": N}}}}</tool_call>\n'
    "The tool answers higher, lower or correct."
)

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the secret number; returns higher, lower or correct.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_INT_RE = re.compile(r"-?\d+")


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


def parse_tool_call(reply: str) -> int | None:
    """The guessed number of the first guess tool call in ``reply`` (JSON, or a bare integer inside)."""
    m = _CALL_RE.search(reply)
    if not m:
        return None
    body = m.group(1).strip()
    try:
        call = json.loads(body)
        if call.get("name") == "guess":
            return int(call["arguments"]["number"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    found = _INT_RE.search(body)
    return int(found.group()) if found else None


def feedback(guess: int, secret: int) -> str:
    if guess == secret:
        return "correct"
    return "higher" if secret > guess else "lower"


def game_reward(solved: bool, num_guesses: int, max_guesses: int) -> float:
    """1 for a first-try hit, decreasing linearly to 0.5 at max_guesses; 0 when unsolved."""
    if not solved:
        return 0.0
    return 1.0 - 0.5 * (num_guesses - 1) / max(1, max_guesses - 1)
