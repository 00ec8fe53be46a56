"""Scene generator, prompts and scoring (no verifiers import). Deterministic in the seed; images are PNG data URLs.

A scene is a ``grid x grid`` board; each shape (circle, square or triangle, in one of four colours) sits in its own
cell, so shapes never overlap and stay countable at 32 pixels. Two question kinds:

* count: "How many red shapes are in the image?" (the answer may be 0);
* colour: "What colour is the triangle?", asked only when exactly one triangle is drawn.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import re
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "Look at the image and answer with one word or number inside <answer></answer>."

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)


def draw_scene(items: list[tuple[str, str, int]], image_size: int, grid: int):
    """PIL image of ``items`` = (shape, colour, cell index) on a white board."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell = image_size / grid
    margin = max(1.0, cell * 0.15)
    for shape, color, index in items:
        x0, y0 = (index % grid) * cell + margin, (index // grid) * cell + margin
        x1, y1 = (index % grid + 1) * cell - margin, (index // grid + 1) * cell - margin
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def generate_examples(n: int, seed: int = 0, image_size: int = 32, grid: int = 2, max_shapes: int = 4) -> list[dict]:
    """``n`` examples ``{"image" (PNG data URL), "question", "answer", "completion", "kind"}``.

    The answer is drawn first and the scene built around it, so that no answer is more likely than another for its
    question: a count uniform in ``[0, max_shapes]``, a colour uniform over the four. A scene drawn first made "0"
    the answer to 50% of the count questions (a random colour over 1-4 shapes), which a policy earned without looking.
    """
    if not 1 <= max_shapes <= grid * grid:
        raise ValueError(f"max_shapes must be in [1, {grid * grid}] for a {grid}x{grid} grid, got {max_shapes}")
    rng = random.Random(seed)
    colors = list(COLORS)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            items, question, answer, kind = _colour_question(rng, grid, max_shapes, colors)
        else:
            items, question, answer, kind = _count_question(rng, grid, max_shapes, colors)
        out.append(
            {
                "image": png_data_url(draw_scene(items, image_size, grid)),
                "question": question,
                "answer": answer,
                "completion": f"<answer>{answer}</answer>",
                "kind": kind,
            }
        )
    return out


def _count_question(rng: random.Random, grid: int, max_shapes: int, colors: list[str]):
    """A scene with ``k`` shapes of the asked colour, ``k`` uniform in ``[0, max_shapes]``, among 1-max_shapes."""
    color, count = rng.choice(colors), rng.randint(0, max_shapes)
    cells = rng.sample(range(grid * grid), rng.randint(max(1, count), max_shapes))
    others = [c for c in colors if c != color]
    items = [(rng.choice(SHAPES), color if i < count else rng.choice(others), c) for i, c in enumerate(cells)]
    return items, f"How many {color} shapes are in the image?", str(count), "count"


def _colour_question(rng: random.Random, grid: int, max_shapes: int, colors: list[str]):
    """A scene with exactly one shape of the asked kind, its colour uniform, among 1-max_shapes shapes."""
    shape, color = rng.choice(SHAPES), rng.choice(colors)
    cells = rng.sample(range(grid * grid), rng.randint(1, max_shapes))
    others = [s for s in SHAPES if s != shape]
    items = [(shape, color, cells[0])] + [(rng.choice(others), rng.choice(colors), c) for c in cells[1:]]
    return items, f"What colour is the {shape}?", color, "colour"


def prompt_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The user turn: the image (OpenAI ``image_url`` part with a data: URL) then the question."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": example["image"]}},
                {"type": "text", "text": example["question"]},
            ],
        }
    ]


def sft_rows(n: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """``messages`` rows (system, user with the image, assistant answer) for SFT."""
    return [
        {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                *prompt_messages(ex),
                {"role": "assistant", "content": ex["completion"]},
            ]
        }
        for ex in generate_examples(n, seed, **kwargs)
    ]


# The tags are found one by one, not by one pattern around the answer: `<answer>\s*(.*?)\s*</answer>` backtracks in
# cubic time over an unclosed `<answer>` and a run of spaces (2,000 spaces: 5 s; 16,000: most of an hour).
_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_CLOSE = re.compile(r"</answer>", re.IGNORECASE)


def last_answer(reply: str) -> str | None:
    """The text of the last ``<answer>`` of ``reply`` that is closed, up to the first ``</answer>`` after it (the
    tags in any case), stripped; None without."""
    closes = [m.start() for m in _CLOSE.finditer(reply)]
    opens = [m.end() for m in _OPEN.finditer(reply, 0, closes[-1])] if closes else []
    if not opens:
        return None
    start = opens[-1]
    return reply[start : _CLOSE.search(reply, start).start()].strip()


def score_answer(reply: str, answer: str) -> float:
    """1.0 when the last ``<answer>`` of the reply equals ``answer`` (case and surrounding space ignored)."""
    found = last_answer(reply or "")
    return 1.0 if found is not None and found.lower() == answer.strip().lower() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a color-shapes SFT dataset (.jsonl of messages rows).")
    parser.add_argument("out", type=Path)
    parser.add_argument("--num-examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()
    rows = sft_rows(args.num_examples, args.seed, image_size=args.image_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
