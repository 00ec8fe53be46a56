"""The color-shapes verifiers Taskset."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from color_shapes.data import SYSTEM_PROMPT, generate_examples, prompt_messages, score_answer


class ColorShapesData(vf.TaskData):
    answer: str
    """The expected word or number."""
    kind: str = "count"
    """Question kind: ``count`` or ``colour``."""


class ColorShapesTask(vf.Task[ColorShapesData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return score_answer(trace.last_reply, self.data.answer)


class ColorShapesConfig(vf.TasksetConfig):
    num_examples: int = 1000
    """Scenes generated."""
    seed: int = 0
    """Generator seed."""
    image_size: int = 32
    """Image side in pixels."""
    grid: int = 2
    """Cells per side of the board (one shape per cell)."""
    max_shapes: int = 4
    """Most shapes in one scene (at most grid * grid)."""


class ColorShapesTaskset(vf.Taskset[ColorShapesTask, ColorShapesConfig]):
    def load(self) -> Iterable[ColorShapesTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.image_size, c.grid, c.max_shapes):
            data = ColorShapesData(
                prompt=prompt_messages(ex), system_prompt=SYSTEM_PROMPT, answer=ex["answer"], kind=ex["kind"]
            )
            yield ColorShapesTask(data)


class ColorShapesHarness(NullHarness):
    """The harness color-shapes ships: a chat task, played by verifiers' tool-less chat loop (``null``; tools only from the
    task's toolsets) rather than verifiers' default for a taskset without one, the ``bash`` coding agent."""
