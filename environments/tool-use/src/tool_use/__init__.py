"""Tool use: large-number arithmetic the model answers by calling a ``calculator`` tool (a ``vf.Toolset``).

``generate_examples`` and ``evaluate`` (plain Python) build the dataset and compute the tool's results;
``ToolUseTaskset`` (imported lazily, it needs verifiers) is the environment.
"""

from tool_use.data import SYSTEM_PROMPT, evaluate, generate_examples, parse_answer

__version__ = "0.1.0"
__all__ = ["ToolUseHarness", "ToolUseTaskset"]

_LAZY = ("ToolUseHarness", "ToolUseTaskset", "ToolUseTask", "ToolUseData", "ToolUseConfig")


def __getattr__(name: str):
    if name in _LAZY:
        from tool_use import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'tool_use' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, evaluate, generate_examples, parse_answer)
