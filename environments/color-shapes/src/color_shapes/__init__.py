"""Coloured shapes drawn offline with Pillow; the model counts them or names a colour (exact-match reward)."""

from color_shapes.data import SYSTEM_PROMPT, generate_examples, prompt_messages, score_answer, sft_rows

__version__ = "0.1.0"
__all__ = ["ColorShapesHarness", "ColorShapesTaskset"]


def __getattr__(name: str):
    if name in ("ColorShapesHarness", "ColorShapesTaskset", "ColorShapesTask", "ColorShapesData", "ColorShapesConfig"):
        from color_shapes import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'color_shapes' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, generate_examples, prompt_messages, score_answer, sft_rows)
