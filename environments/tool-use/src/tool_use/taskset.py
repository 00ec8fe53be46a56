"""The tool-use verifiers Taskset: each task launches the calculator toolset for its rollout."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

from tool_use.calculator import CalculatorToolset
from tool_use.data import SYSTEM_PROMPT, generate_examples, parse_answer


class ToolUseData(vf.TaskData):
    expression: str
    """The arithmetic expression asked about."""
    answer: str
    """Its exact integer value."""


class ToolUseTaskConfig(vf.TaskConfig):
    calculator: vf.ToolsetConfig = vf.ToolsetConfig()
    """Where the calculator server runs (default: a local subprocess)."""


class ToolUseTask(vf.Task[ToolUseData, vf.State, ToolUseTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolUseTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.calculator)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if parse_answer(trace.last_reply) == int(self.data.answer) else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ToolUseConfig(vf.TasksetConfig):
    num_examples: int = 10_000
    """Problems generated."""
    seed: int = 0
    """Generator seed."""
    digits: int = 4
    """Digits per operand."""
    terms: int = 2
    """Operands per expression."""
    task: ToolUseTaskConfig = ToolUseTaskConfig()
    """Per-task knobs (the calculator's placement)."""


class ToolUseTaskset(vf.Taskset[ToolUseTask, ToolUseConfig]):
    def load(self) -> Iterable[ToolUseTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.digits, c.terms):
            data = ToolUseData(
                prompt=ex["prompt"], system_prompt=SYSTEM_PROMPT, expression=ex["expression"], answer=ex["answer"]
            )
            yield ToolUseTask(data, c.task)
