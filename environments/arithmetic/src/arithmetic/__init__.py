"""Generated arithmetic word problems with verifiable numeric answers, scored with math-verify."""

from arithmetic.data import SYSTEM_PROMPT, generate_examples, score_answer

__version__ = "0.1.0"
__all__ = ["ArithmeticHarness", "ArithmeticTaskset"]


def __getattr__(name: str):
    if name in ("ArithmeticHarness", "ArithmeticTaskset", "ArithmeticTask", "ArithmeticData", "ArithmeticConfig"):
        from arithmetic import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'arithmetic' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, generate_examples, score_answer)
