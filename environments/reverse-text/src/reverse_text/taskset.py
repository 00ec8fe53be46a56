"""The reverse-text verifiers Taskset."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from reverse_text.data import SYSTEM_PROMPT, generate_examples, lcs_ratio


class ReverseTextData(vf.TaskData):
    answer: str
    """The prompt reversed."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply, self.data.answer)


class ReverseTextConfig(vf.TasksetConfig):
    num_examples: int = 10_000
    """Examples generated."""
    seed: int = 0
    """Generator seed."""
    min_chars: int = 5
    """Shortest text."""
    max_chars: int = 20
    """Longest text."""


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> Iterable[ReverseTextTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.min_chars, c.max_chars):
            yield ReverseTextTask(
                ReverseTextData(prompt=ex["prompt"], system_prompt=SYSTEM_PROMPT, answer=ex["answer"])
            )


class ReverseTextHarness(NullHarness):
    """The harness reverse-text ships: a chat task, played by verifiers' tool-less chat loop (``null``; tools only from the
    task's toolsets) rather than verifiers' default for a taskset without one, the ``bash`` coding agent."""
