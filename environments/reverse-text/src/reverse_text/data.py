"""The reverse-text dataset and reward, without verifiers (usable for SFT data)."""

from __future__ import annotations

import difflib
import random

SYSTEM_PROMPT = "Reverse the text character by character. Put your answer in <reversed> tags."

WORDS = [
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "bird",
    "fish",
    "rain",
    "snow",
    "wind",
    "star",
    "leaf",
    "rock",
    "sand",
    "sea",
    "sky",
    "red",
    "blue",
    "green",
    "gold",
    "apple",
    "bread",
    "milk",
    "tea",
    "cup",
    "pen",
    "book",
    "door",
    "road",
    "hill",
    "lake",
    "rose",
    "king",
    "queen",
    "ship",
    "boat",
    "song",
    "word",
]

_OPEN, _CLOSE = "<reversed>", "</reversed>"


def generate_examples(n: int, seed: int = 0, min_chars: int = 5, max_chars: int = 20) -> list[dict[str, str]]:
    """``n`` examples ``{"prompt", "answer", "completion", "system_prompt"}``, deterministic in ``seed``.

    Each prompt is a few words from a fixed list, 5-20 characters; ``answer`` is it reversed and
    ``completion`` the ideal reply (for SFT).
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        target = rng.randint(min_chars, max_chars)
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        text = " ".join(words)[:target].strip()
        if len(text) < min_chars:
            text = (text + " " + rng.choice(WORDS))[:min_chars].ljust(min_chars, "a")
        answer = text[::-1]
        examples.append(
            {
                "prompt": text,
                "answer": answer,
                "completion": f"<reversed>{answer}</reversed>",
                "system_prompt": SYSTEM_PROMPT,
            }
        )
    return examples


def parse_answer(reply: str) -> str | None:
    """Content of the first ``<reversed>...</reversed>`` (stripped), or None without the tags."""
    # str.find, not a regex: a lazy pattern scans to the end from every unclosed `<reversed>` (quadratic time).
    start = reply.find(_OPEN)
    end = reply.find(_CLOSE, start + len(_OPEN)) if start >= 0 else -1
    return reply[start + len(_OPEN) : end].strip() if end >= 0 else None


def lcs_ratio(reply: str, answer: str) -> float:
    """LCS ratio ``2 M / (len(a) + len(b))`` between the tagged answer and ``answer`` (both stripped), in [0, 1];
    0 for a tagged answer at least as close to the text it reverses (``answer[::-1]``) as to ``answer``.

    The ratio alone paid for any of the text's letters in any order: the prompt copied back scored 0.23 on average,
    the prompt's letters sorted 0.40, a fixed string of common letters 0.26, and the prompt followed by its reversal
    (a hedge) 0.67, none of it reversing anything. A reply that reverses even part of the text is closer to the
    reversal than to the text, and keeps its ratio."""
    parsed = parse_answer(reply)
    if parsed is None:
        return 0.0
    # The tagged answer is stripped, so the target is too: a prompt cut after a space ("lake ") made the perfect
    # reply score 0.89.
    target = answer.strip()
    ratio = difflib.SequenceMatcher(None, parsed, target).ratio()
    unreversed = target[::-1]
    if unreversed != target and difflib.SequenceMatcher(None, parsed, unreversed).ratio() >= ratio:
        return 0.0
    return ratio
