"""The arithmetic verifiers Taskset."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from arithmetic.data import SYSTEM_PROMPT, generate_examples
from arithmetic.verify import bounded_score


class ArithmeticData(vf.TaskData):
    answer: str
    """The exact numeric answer."""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        # In a child process: sympy would compute a boxed power tower for ever, blocking the worker's event loop.
        return await bounded_score(trace.last_reply, self.data.answer)


class ArithmeticConfig(vf.TasksetConfig):
    num_examples: int = 10_000
    """Problems generated."""
    seed: int = 0
    """Generator seed."""
    max_operand: int = 20
    """Largest operand."""
    hard_fraction: float = 0.0
    """Share of problems (drawn per problem) with operands up to ``hard_max_operand``: a mix of easy and hard."""
    hard_max_operand: int = 100
    """Largest operand of the hard problems."""


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> Iterable[ArithmeticTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.max_operand, c.hard_fraction, c.hard_max_operand):
            yield ArithmeticTask(ArithmeticData(prompt=ex["prompt"], system_prompt=SYSTEM_PROMPT, answer=ex["answer"]))


class ArithmeticHarness(NullHarness):
    """The harness arithmetic ships: a chat task, played by verifiers' tool-less chat loop (``null``; tools only from the
    task's toolsets) rather than verifiers' default for a taskset without one, the ``bash`` coding agent."""
