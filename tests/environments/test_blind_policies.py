"""The shipped environments against policies that do not solve the task: a reward a policy earns without reading the
picture or doing the arithmetic is a shortcut RL teaches. Each check is the blind policy's mean reward over
generated examples against the chance level of its question kind."""

from __future__ import annotations

import collections
import functools
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


def _code_reward(task: dict, source: str) -> float:
    """The fraction of ``task``'s hidden tests ``source`` passes, judged as the sandbox's host side judges it (the
    values cross as JSON; ``judge`` compares). Only our own stubs run here, on the host."""
    import copy
    import json

    from prime_orchestrator.sandbox.pyharness import _jsonable
    from prime_orchestrator.sandbox.schemas import TestCase, judge

    ns: dict = {}
    exec(source, ns)
    lines = []
    for i, case in enumerate(task["tests"]):
        try:
            lines.append({"i": i, "value": json.loads(json.dumps(_jsonable(eval(case["expr"], copy.copy(ns)))))})
        except Exception as e:  # noqa: BLE001 - a stub that raises fails that test, as in the sandbox
            lines.append({"i": i, "error": repr(e)})
    tests = [TestCase.model_validate(t) for t in task["tests"]]
    return sum(o.passed for o in judge(tests, lines)) / len(tests)


@functools.cache
def _make_sft_data():
    """examples/code/make_sft_data.py, whose ``lookup_table`` (the prompt's two example calls, else None) is the SFT
    data's wrong policy."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "code" / "make_sft_data.py"
    spec = importlib.util.spec_from_file_location("make_sft_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "args",
    [
        {"num_tests": 5},  # the environment's default
        {"num_tests": 8},  # examples/code/rl_gpu.toml
        {
            "num_tests": 5,
            "families": ["sum_divisible", "count_chars", "digit_power", "primes"],
        },  # examples/code/rl.toml
    ],
)
def test_code_tasks_no_blind_function_beats_one_test(args):
    """A stub returning its family's most frequent expected value (fit on other seeds) passed 0.33 of the hidden
    tests: the family's edge cases were always tested and their answers are common constants (0, [], None, True).
    The hidden tests now take pairwise distinct values where the family has that many, so a constant passes at
    most one of n; echoing the argument and the SFT data's lookup table of the shown calls earn no more. The
    reference solution still passes every test."""
    from code_tasks import generate_tasks

    n = args["num_tests"]
    fit = collections.defaultdict(collections.Counter)
    for seed in (1, 2):
        for task in generate_tasks(1000, seed=seed, **args):
            for case in task["tests"]:
                fit[task["family"]][repr(case["expected"])] += 1
    common = {family: values.most_common(1)[0][0] for family, values in fit.items()}
    rewards, constant = collections.defaultdict(list), collections.defaultdict(list)
    for task in generate_tasks(1500, seed=0, **args):
        name = family = task["family"]
        stubs = {
            "most_frequent": f"def {name}(*args):\n    return {common[family]}\n",
            "none": f"def {name}(*args):\n    return None\n",
            "echo": f"def {name}(*args):\n    return args[0]\n",
            "table": _make_sft_data().lookup_table(task["prompt"]),
        }
        for policy, source in stubs.items():
            rewards[policy].append(_code_reward(task, source))
        constant[family].append(rewards["most_frequent"][-1])
        assert _code_reward(task, task["reference"]) == 1.0, task["id"]
    means = {policy: sum(got) / len(got) for policy, got in rewards.items()}
    assert all(mean <= 1 / n + MARGIN for mean in means.values()), (n, means)
    # Per family, a constant earns one test of n, or chance where the answer is True or False.
    by_family = {family: sum(got) / len(got) for family, got in constant.items()}
    chance = {"balanced": 1 / 2}
    assert all(got <= max(1 / n, chance.get(f, 0)) + MARGIN for f, got in by_family.items()), (n, by_family)


def test_reverse_text_pays_for_reversing_not_for_the_letters():
    """The LCS ratio paid for the text's letters in any order: the prompt copied back earned 0.23 on average, its
    letters sorted 0.40, the prompt followed by its reversal (a hedge) 0.67. A tagged answer at least as close to the
    prompt as to its reversal scores 0; a reversal, whole or with a slip, keeps its ratio (a fragment too short to
    tell, ``or`` of ``or god``, scores 0)."""
    import difflib

    from reverse_text import generate_examples, lcs_ratio

    examples = generate_examples(1000, seed=0)

    def mean(policy) -> float:
        return sum(lcs_ratio(f"<reversed>{policy(e['prompt'])}</reversed>", e["answer"]) for e in examples) / 1000

    assert mean(lambda p: p) == mean(lambda p: p + p[::-1]) == 0.0
    assert mean(lambda p: "".join(sorted(p))) <= 0.25
    assert mean(lambda p: " ".join(p.split()[::-1])) <= MARGIN  # the words' order reversed, not their letters
    for e in examples:
        target = e["answer"].strip()
        for slip in (target, target[1:], target[:-1] + "x", target[:2] + target[3:]):  # scored as before
            want = difflib.SequenceMatcher(None, slip.strip(), target).ratio()
            assert lcs_ratio(f"<reversed>{slip}</reversed>", e["answer"]) == want, (e["prompt"], slip)
