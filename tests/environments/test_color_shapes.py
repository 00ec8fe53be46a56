"""color-shapes: deterministic scenes, answers that match what is drawn, scoring, and loading through verifiers."""

from __future__ import annotations

import numpy as np
from prime_core.vision import load_image


def test_generator_is_deterministic_and_answers_match_the_pixels():
    from color_shapes import generate_examples
    from color_shapes.data import COLORS

    a, b = generate_examples(40, seed=5), generate_examples(40, seed=5)
    assert a == b and a != generate_examples(40, seed=6)
    assert {e["kind"] for e in a} == {"count", "colour"}
    for ex in a:
        pixels = np.asarray(load_image(ex["image"]).convert("RGB"))
        assert pixels.shape == (32, 32, 3)
        present = {name for name, rgb in COLORS.items() if (pixels == rgb).all(-1).any()}
        if ex["kind"] == "colour":
            assert ex["answer"] in present
        else:
            color = ex["question"].split()[2]
            assert (ex["answer"] == "0") == (color not in present)
        assert ex["completion"] == f"<answer>{ex['answer']}</answer>"


def test_score_answer():
    from color_shapes import score_answer

    assert score_answer("<answer>3</answer>", "3") == 1.0
    assert score_answer("I think <answer> Red </answer>", "red") == 1.0
    assert score_answer("<answer>2</answer> no, <answer>3</answer>", "3") == 1.0
    assert score_answer("3", "3") == 0.0
    assert score_answer("<answer>4</answer>", "3") == 0.0


def test_sft_rows_hold_the_image_inline():
    from color_shapes import sft_rows

    rows = sft_rows(3, seed=1)
    messages = rows[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    part = messages[1]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")


def test_taskset_loads_through_verifiers():
    import verifiers.v1 as vf

    taskset = vf.load_taskset(
        vf.resolve_env_config({"taskset": {"id": "color-shapes", "num_examples": 4, "seed": 2}}).taskset
    )
    t = next(iter(taskset))
    assert t.data.system_prompt and t.data.prompt[0].content[0].type == "image_url"
    assert [fn.__name__ for fn in t.hooks("reward")] == ["correct"]
