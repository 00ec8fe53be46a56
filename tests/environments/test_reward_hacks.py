"""The shipped environments against a reward-hacking policy: replies that would hang, crash or slow the env worker,
or score without solving the task. Each reward runs as the env worker runs it (the task's async reward hook)."""

import subprocess
import sys
import textwrap

import pytest


class _Trace:
    """What the rewards read of a verifiers trace."""

    def __init__(self, reply: str):
        self.last_reply = reply
        self.tool_messages = []


def _run(script: str, timeout: float) -> str:
    """Run ``script`` in a fresh interpreter (a blocked event loop cannot be interrupted in this one)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the reward did not return within {timeout:.0f} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_arithmetic_power_tower_scores_zero_without_blocking_the_event_loop():
    """``\\boxed{9^{9^{9^{9}}}}`` made sympy compute for ever inside the reward, blocking the worker's event loop
    (every rollout it serves). Power towers are now refused as not numbers, but sympy still spends seconds parsing a
    long reply: it scores 0 when the scorer's bound runs out, and the loop keeps running meanwhile."""
    out = _run(
        """
        import asyncio, logging
        from arithmetic.taskset import ArithmeticData, ArithmeticTask
        from arithmetic import verify

        verify._scorer = verify.Scorer(timeout_s=3.0)
        bounds_run_out = []
        handler = logging.Handler()
        handler.emit = lambda record: bounds_run_out.append("took over" in record.getMessage())
        logging.getLogger(verify.__name__).addHandler(handler)

        class Trace:
            def __init__(self, reply): self.last_reply = reply

        def task(answer):
            return ArithmeticTask(ArithmeticData(prompt="p", answer=answer))

        async def main():
            assert await task("7").correct(Trace("so \\\\boxed{\\\\frac{14}{2}}")) == 1.0  # starts the child
            # sympy parses a 60 kB sum for over 10 s
            replies = ["\\\\boxed{" + "+".join([digit] * 30000) + "}" for digit in "12"]
            bombs = [asyncio.create_task(task("7").correct(Trace(r))) for r in replies]
            await asyncio.sleep(0.5)  # wakes only once the loop is free again
            pending_while_loop_ran = sum(not b.done() for b in bombs)
            scores = await asyncio.gather(*bombs)
            after = await task("12").correct(Trace("\\\\boxed{\\\\frac{24}{2}}"))
            print(scores, pending_while_loop_ran, sum(bounds_run_out), after)

        asyncio.run(main())
        """,
        timeout=90,
    )
    scores, pending, bounds_run_out, after = out.rsplit("]", 1)[0] + "]", *out.rsplit("]", 1)[1].split()
    assert scores == "[0.0, 0.0]"
    assert int(pending) == 2  # the loop served another coroutine while both replies were being scored
    assert int(bounds_run_out) == 2  # each scored 0 because the bound ran out, not because it parsed as wrong
    assert float(after) == 1.0  # the restarted child scores right answers


def test_arithmetic_right_answers_are_not_queued_behind_power_towers():
    """The scoring child takes one reply at a time, so while it spent its bound on a power tower (10 s, then a
    restart) every right answer of the worker waited: 50 boxed integers scored only after the tower had timed out.
    A boxed plain integer is scored without the child, while the tower is still being computed."""
    out = _run(
        """
        import asyncio
        from arithmetic.taskset import ArithmeticData, ArithmeticTask
        from arithmetic import verify

        verify._scorer = verify.Scorer(timeout_s=60.0)

        class Trace:
            def __init__(self, reply): self.last_reply = reply

        def task(answer):
            return ArithmeticTask(ArithmeticData(prompt="p", answer=answer))

        async def main():
            assert await task("7").correct(Trace("\\\\boxed{\\\\frac{14}{2}}")) == 1.0  # starts the child
            tower = asyncio.create_task(task("7").correct(Trace("\\\\boxed{9^{9^{9^{9}}}}")))
            await asyncio.sleep(0)  # the tower holds the child
            right = [task(str(n)).correct(Trace(f"so \\\\boxed{{{n}}}")) for n in range(50)]
            wrong = [task(str(n)).correct(Trace(f"\\\\boxed{{ {n + 1} }}")) for n in range(50)]
            scores = await asyncio.gather(*right, *wrong)
            print(sum(scores[:50]), sum(scores[50:]), tower.done())
            tower.cancel()

        asyncio.run(main())
        """,
        timeout=120,
    )
    assert out.split() == ["50.0", "0.0", "False"]


def test_arithmetic_integers_scored_without_the_child_score_as_math_verify_scores_them():
    """The parent's plain-integer path gives math-verify's score on every reply it takes; other replies go to it."""
    from arithmetic.data import plain_integer_score, score_answer

    replies = [
        "\\boxed{12}",
        "\\boxed{ 012 }",
        "\\boxed{+12}",
        "\\boxed{-12}",
        "\\boxed{-0}",
        "\\boxed{13}",
        "\\boxed{1}\\boxed{12}",
    ]
    for reply in replies:
        for answer in ("12", "-12", "0", "13"):
            assert plain_integer_score(reply, answer) == score_answer(reply, answer), (reply, answer)
    for reply in ("\\boxed{1,500}", "\\boxed{12.0}", "\\boxed{\\frac{24}{2}}", "\\boxed{１２}", "12", "\\boxed{- 5}"):
        assert plain_integer_score(reply, "12") is None, reply


def _reward(coro) -> float:
    import asyncio

    return asyncio.run(coro)


@pytest.mark.parametrize("reply", ["<answer>,</answer>", "<answer>" + "9" * 5000 + "</answer>"])
def test_tool_use_unparseable_answer_scores_zero(reply):
    """An answer of commas only, or of more digits than Python converts, raised ValueError in the reward (the
    rollout failed instead of scoring 0)."""
    from tool_use.taskset import ToolUseData, ToolUseTask

    task = ToolUseTask(ToolUseData(prompt="p", expression="2 + 2", answer="4"))
    assert _reward(task.correct(_Trace(reply))) == 0.0
    assert _reward(task.correct(_Trace("<answer>4</answer>"))) == 1.0


@pytest.mark.parametrize("expression", ["1" + "+1" * 2000, "-" * 1500 + "1", "1" + "*1" * 1500, "1 + " * 600 + "1"])
def test_calculator_refuses_deep_or_long_expressions_with_its_error(expression):
    """A long chain (``1+1+...+1``) or ``----1`` raised RecursionError or MemoryError out of the tool instead of
    the calculator's ``error: ...`` answer to the model."""
    from tool_use.calculator import CalculatorToolset

    assert CalculatorToolset.evaluate(None, expression).startswith("error: ")
    assert CalculatorToolset.evaluate(None, "(2 + 3) * 4") == "20"


def test_guess_number_guess_of_thousands_of_digits_is_no_guess():
    """``<guess>99...9</guess>`` past 4300 digits raised ValueError inside the game loop (the episode failed); the
    game answers with its format reminder, as for a reply without a guess."""
    from guess_number import feedback, parse_guess

    huge = "<guess>" + "9" * 5000 + "</guess>"
    assert parse_guess(huge) is None and feedback(parse_guess(huge), 5) == feedback(None, 5)
    assert parse_guess("<guess>" + "9" * 40 + "</guess>") == int("9" * 40)  # out of range: just a wrong guess


def test_color_shapes_and_reverse_text_parse_long_unclosed_replies_in_linear_time():
    """color-shapes' ``<answer>\\s*(.*?)\\s*</answer>`` backtracked in cubic time over an unclosed ``<answer>`` and a
    run of spaces (2,000 spaces: 5 s, 16,000: about 40 min, the worker's event loop blocked throughout);
    reverse-text's lazy pattern rescanned to the end from every unclosed ``<reversed>`` (quadratic)."""
    out = _run(
        """
        import asyncio
        from color_shapes.taskset import ColorShapesData, ColorShapesTask
        from reverse_text.taskset import ReverseTextData, ReverseTextTask

        class Trace:
            def __init__(self, reply): self.last_reply = reply

        shapes = ColorShapesTask(ColorShapesData(prompt="p", answer="red"))
        text = ReverseTextTask(ReverseTextData(prompt="p", answer="tac"))
        replies = ["<answer>" + " " * 16000, "<answer>" + "\\n" * 8000 + "x" + " " * 8000, "<answer>" * 2000]
        print([asyncio.run(shapes.correct(Trace(r))) for r in replies])
        print(asyncio.run(text.lcs(Trace("<reversed>" * 40000))))
        print(asyncio.run(shapes.correct(Trace("<answer>x</answer> no: <ANSWER> Red </answer>"))))
        print(asyncio.run(text.lcs(Trace("<reversed> tac </reversed>"))))
        """,
        timeout=60,
    )
    assert out.split() == ["[0.0,", "0.0,", "0.0]", "0.0", "1.0", "1.0"]


def test_reverse_text_perfect_reply_scores_one_for_every_prompt():
    """4% of the prompts end with a space ("lake "), so their answer starts with one, which the stripped tagged reply
    never matched: the ideal completion scored 0.89."""
    from reverse_text import generate_examples, lcs_ratio

    examples = generate_examples(1000, seed=0)
    assert any(e["prompt"].endswith(" ") for e in examples)
    assert [lcs_ratio(e["completion"], e["answer"]) for e in examples] == [1.0] * len(examples)


def test_hedged_replies_score_zero_in_every_environment():
    """Several candidates in one reply (the refusals docs/environments.md lists): only one answer counts, and a
    list or an alternative as the answer is no answer. Measured on the current parsers, which already refuse them."""
    from arithmetic import score_answer as arithmetic
    from color_shapes import score_answer as shapes
    from guess_number import parse_guess
    from reverse_text import lcs_ratio
    from tool_use.data import parse_answer

    for reply in (
        "\\boxed{12, 13}",
        "\\boxed{12 \\text{ or } 13}",
        "\\boxed{\\{12, 13\\}}",
        "\\boxed{13}\\boxed{12,13}",
    ):
        assert arithmetic(reply, "13") == 0.0, reply
    assert arithmetic("\\boxed{12}\\boxed{13}", "12") == 0.0  # the last box is the answer
    for reply in (
        "<answer>red, blue</answer>",
        "<answer>red or blue</answer>",
        "<answer>red</answer><answer>blue</answer>",
    ):
        assert shapes(reply, "red") == 0.0, reply
    assert parse_guess("".join(f"<guess>{n}</guess>" for n in range(1, 17))) == 16  # one guess, the last
    assert parse_answer("<answer>12</answer> or <answer>13</answer>") == 13
    assert lcs_ratio("<reversed>xyz</reversed><reversed>cat</reversed>", "cat") == 0.0  # the first tag counts
