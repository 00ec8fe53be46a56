import re

import pytest


def test_reverse_text_generator_and_reward():
    from reverse_text import generate_examples, lcs_ratio

    a, b = generate_examples(50, seed=3), generate_examples(50, seed=3)
    assert a == b and a != generate_examples(50, seed=4)
    assert all(5 <= len(e["prompt"]) <= 20 and e["answer"] == e["prompt"][::-1] for e in a)
    assert lcs_ratio("<reversed>cba</reversed>", "cba") == 1.0
    assert lcs_ratio("cba", "cba") == 0.0
    assert lcs_ratio("<reversed> cb </reversed>", "cba") == pytest.approx(0.8)
    assert lcs_ratio(a[0]["completion"], a[0]["answer"]) == 1.0


def test_arithmetic_generator_and_math_verify():
    from arithmetic import generate_examples, score_answer

    ex = generate_examples(20, seed=1)
    assert ex == generate_examples(20, seed=1)
    assert all(score_answer(e["completion"], e["answer"]) == 1.0 for e in ex)
    assert score_answer("\\boxed{-1}", ex[0]["answer"]) == 0.0
    assert score_answer("I don't know", "3") == 0.0
    mixed = generate_examples(400, seed=1, max_operand=10, hard_fraction=0.5, hard_max_operand=99)
    big = [e for e in mixed if any(int(n) > 10 for n in re.findall(r"\d+", e["prompt"]))]
    assert 0.4 < len(big) / len(mixed) < 0.6  # half are hard
    assert all(int(n) <= 99 for e in mixed for n in re.findall(r"\d+", e["prompt"]))


def test_guess_number_game():
    from guess_number import feedback, game_reward, generate_examples, parse_guess

    assert generate_examples(5, seed=2) == generate_examples(5, seed=2)
    assert parse_guess("I think <guess>7</guess>") == 7
    assert parse_guess("<guess>3</guess> no, <guess> 9 </guess>") == 9
    assert parse_guess("7") is None
    assert (feedback(3, 5), feedback(7, 5), feedback(5, 5)) == ("higher", "lower", "correct")
    assert "<guess>" in feedback(None, 5)
    assert game_reward(True, 1, 6) == 1.0 and game_reward(True, 6, 6) == 0.5 and game_reward(False, 3, 6) == 0.0


def test_tool_use_generator_and_calculator():
    from tool_use import evaluate, generate_examples, parse_answer

    ex = generate_examples(30, seed=1)
    assert ex == generate_examples(30, seed=1) and ex != generate_examples(30, seed=2)
    assert all(evaluate(e["expression"]) == int(e["answer"]) for e in ex)
    assert all(1000 <= int(x) <= 9999 for e in ex for x in e["expression"].split()[::2])
    assert evaluate("(2 + 3) * -4 // 3 % 5") == ((2 + 3) * -4 // 3) % 5
    for bad in ("__import__('os')", "2 ** 99999", "1 // 0", "2.5 * 2", "x + 1", "9" * 20 + " * " + "9" * 20):
        with pytest.raises(ValueError):
            evaluate(bad)
    assert parse_answer("so <answer>1,234</answer>") == 1234 and parse_answer("1234") is None


@pytest.mark.parametrize(
    ("env_id", "args", "env_cls"),
    [
        ("reverse-text", {"num_examples": 3}, "SingleAgentEnv"),
        ("arithmetic", {"num_examples": 3}, "SingleAgentEnv"),
        ("color-shapes", {"num_examples": 3}, "SingleAgentEnv"),
        ("tool-use", {"num_examples": 3}, "SingleAgentEnv"),
        ("guess-number", {"num_examples": 3}, "GuessNumberEnv"),
    ],
)
def test_environments_load_through_verifiers_loaders(env_id, args, env_cls):
    """What verifiers' own eval and env server resolve for each id: the taskset, its tasks, and the Env class."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import resolve_env_config

    config = resolve_env_config({"taskset": {"id": env_id, **args}})
    assert vf.environment_class(env_id).__name__ == env_cls
    tasks = list(vf.load_taskset(config.taskset))
    assert len(tasks) == 3 and [t.data.idx for t in tasks] == [0, 1, 2]
    assert tasks[0].data.prompt and tasks[0].hooks("reward") or env_cls == "GuessNumberEnv"


def test_tool_use_declares_its_calculator_toolset():
    import verifiers.v1 as vf
    from tool_use.calculator import CalculatorToolset

    taskset = vf.load_taskset(vf.resolve_env_config({"taskset": {"id": "tool-use"}}).taskset)
    # Taskset-scoped: one server per env worker, not a Python process per rollout.
    (toolset,) = type(taskset).toolsets(taskset.config)
    assert type(taskset).task_type().toolsets(vf.TaskConfig()) == []
    assert isinstance(toolset, CalculatorToolset) and toolset.server_name == "calculator"
    assert toolset.evaluate("1234 * 5678") == str(1234 * 5678)
    assert toolset.evaluate("import os").startswith("error:")


def test_code_tasks_restricted_to_families():
    from code_tasks import generate_tasks

    # None keeps the draw of every family unchanged; a subset draws only its own.
    assert generate_tasks(30, seed=3) == generate_tasks(30, seed=3, families=None)
    tasks = generate_tasks(40, seed=3, families=["primes", "digit_power"])
    assert {t["family"] for t in tasks} == {"primes", "digit_power"}
    with pytest.raises(ValueError, match="nope"):
        generate_tasks(1, families=["nope"])


def test_code_tasks_prompts_stay_what_the_shipped_model_learned():
    """The hidden tests are drawn apart from the prompts: changing how they are chosen leaves every prompt and
    reference as examples/code/model was SFT'd on (seed 1234) and as the GPU example trains on (8 tests)."""
    import hashlib

    from code_tasks import generate_tasks

    four = ["sum_divisible", "count_chars", "digit_power", "primes"]
    pinned = {
        "0076390175e8cc0c55e888ce2522f6312be2bf1a442d9156e1631457ac769416": dict(n=300, seed=1234, families=four),
        "e0f5f98aff0ef9fd446d65555038510a899b188b042bda919892f6eb7d419886": dict(n=300, seed=0, num_tests=8),
    }
    for digest, args in pinned.items():
        shown = "\n".join(t["prompt"] + t["reference"] for t in generate_tasks(**args))
        assert hashlib.sha256(shown.encode()).hexdigest() == digest, args
