"""The tool-use verifiers Taskset: one calculator server per env worker, shared by its rollouts.

The calculator is stateless, so it is a taskset-scoped toolset (verifiers starts it once per env worker) rather
than a task-scoped one: a task-scoped server is a Python process per rollout, about 5 s of CPU each (importing
verifiers), which starved a 16-core GPU host at 64 rollouts in flight.
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from tool_use.calculator import CalculatorToolset
from tool_use.data import SYSTEM_PROMPT, generate_examples, parse_answer


class ToolUseData(vf.TaskData):
    expression: str
    """The arithmetic expression asked about."""
    answer: str
    """Its exact integer value."""


class ToolUseTask(vf.Task[ToolUseData, vf.State, vf.TaskConfig]):
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
    calculator: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the shared calculator server runs (default: a local subprocess per env worker; or ``url``)."""


class ToolUseTaskset(vf.Taskset[ToolUseTask, ToolUseConfig]):
    @classmethod
    def toolsets(cls, config: ToolUseConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.calculator)]

    def load(self) -> Iterable[ToolUseTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.digits, c.terms):
            data = ToolUseData(
                prompt=ex["prompt"], system_prompt=SYSTEM_PROMPT, expression=ex["expression"], answer=ex["answer"]
            )
            yield ToolUseTask(data)


class ToolUseHarness(NullHarness):
    """The harness tool-use ships: a chat task, played by verifiers' tool-less chat loop (``null``; tools only from the
    task's toolsets) rather than verifiers' default for a taskset without one, the ``bash`` coding agent."""
