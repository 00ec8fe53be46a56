"""Multi-turn number guessing: the model calls a ``guess`` tool and gets higher/lower feedback."""

from guess_number.data import SYSTEM_PROMPT, generate_examples, parse_tool_call

__version__ = "0.1.0"
__all__ = ["GuessNumberTaskset"]


def __getattr__(name: str):
    if name in ("GuessNumberTaskset", "GuessNumberTask", "GuessNumberData", "GuessNumberConfig"):
        from guess_number import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'guess_number' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, generate_examples, parse_tool_call)
