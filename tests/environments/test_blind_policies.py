"""The shipped environments against policies that do not solve the task: a reward a policy earns without reading the
picture or doing the arithmetic is a shortcut RL teaches. Each check is the blind policy's mean reward over
generated examples against the chance level of its question kind."""

from __future__ import annotations

import collections
import re

import pytest

MARGIN = 0.05


@pytest.mark.parametrize("scene", [{}, {"image_size": 64, "grid": 3, "max_shapes": 6}])
def test_color_shapes_no_blind_answer_beats_chance(scene):
    """The most frequent answer to each question text (fit on other scenes) was "0" for every count question and
    earned 0.50 on them (a random colour over 1-4 shapes of four colours is mostly absent), 2.5x chance."""
    from color_shapes import generate_examples, score_answer

    fit = collections.defaultdict(collections.Counter)
    for ex in generate_examples(2000, seed=1, **scene):
        fit[ex["question"]][ex["answer"]] += 1
    blind = {question: answers.most_common(1)[0][0] for question, answers in fit.items()}
    rewards = collections.defaultdict(list)
    for ex in generate_examples(2000, seed=0, **scene):
        guess = blind.get(ex["question"], "0")
        rewards[ex["kind"]].append(score_answer(f"<answer>{guess}</answer>", ex["answer"]))
    chance = {"count": 1 / (scene.get("max_shapes", 4) + 1), "colour": 1 / 4}
    for kind, got in rewards.items():
        assert len(got) > 600, (kind, len(got))
        assert sum(got) / len(got) <= chance[kind] + MARGIN, (kind, sum(got) / len(got), chance[kind])


def test_arithmetic_pays_for_the_number_not_the_expression():
    """math-verify evaluates what it parses, so boxing the problem's operands and operator (``\\boxed{12 \\times 17}``,
    no arithmetic done) scored 1.0 on every problem; it scores 0, and the computed number still scores 1."""
    from arithmetic import generate_examples, score_answer

    ops = {"finds": "+", "gives away": "-", "boxes": "\\times", "pages": "+"}
    copied, solved = [], []
    for ex in generate_examples(150, seed=0):
        a, b = re.findall(r"\d+", ex["prompt"])[:2]
        op = next(sign for word, sign in ops.items() if word in ex["prompt"])
        copied.append(score_answer(f"\\boxed{{{a} {op} {b}}}", ex["answer"]))
        copied.append(score_answer(f"The answer is {a}{op}{b}.", ex["answer"]))
        solved.append(score_answer(f"{a} {op} {b} = \\boxed{{{ex['answer']}}}", ex["answer"]))
    assert sum(copied) / len(copied) <= MARGIN, sum(copied) / len(copied)
    assert solved == [1.0] * len(solved)
    assert score_answer("\\boxed{\\frac{24}{2}}", "12") == score_answer("so 1,500 in all", "1500") == 1.0
