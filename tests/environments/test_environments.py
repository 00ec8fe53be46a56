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


def test_guess_number_game():
    from guess_number import generate_examples, parse_tool_call
    from guess_number.data import feedback, game_reward

    assert generate_examples(5, seed=2) == generate_examples(5, seed=2)
    assert parse_tool_call('<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call>') == 7
    assert parse_tool_call("<tool_call>guess 9</tool_call>") == 9
    assert parse_tool_call("no call") is None
    assert (feedback(3, 5), feedback(7, 5), feedback(5, 5)) == ("higher", "lower", "correct")
    assert game_reward(True, 1, 6) == 1.0 and game_reward(False, 3, 6) == 0.0


def test_tasksets_load_through_verifiers_and_score():
    import asyncio

    from prime_orchestrator.env_worker import RolloutTrace, load_tasks, score

    tasks = load_tasks("reverse-text", {"num_examples": 3})
    t = tasks[0]
    trace = RolloutTrace([{"role": "assistant", "content": f"<reversed>{t.data.answer}</reversed>"}], {}, 1)
    assert asyncio.run(score(t, trace))[0] == 1.0
    g = load_tasks("guess-number", {"num_examples": 2})[0]
    info: dict = {}
    msgs = [
        {
            "role": "assistant",
            "content": f'<tool_call>{{"name": "guess", "arguments": {{"number": {g.data.secret}}}}}</tool_call>',
        }
    ]
    assert g.env_response(msgs, info) is None and info["solved"]
    total, signals = asyncio.run(score(g, RolloutTrace(msgs, info, 1)))
    assert total == 1.0 and signals["metric/num_guesses"] == 1.0
