"""Reverse a short chunk of text (LCS-ratio reward).

``generate_examples`` (plain Python, no verifiers import) builds the deterministic dataset, also usable as
SFT data; ``ReverseTextTaskset`` (imported lazily, it needs verifiers) is the environment.
"""

from reverse_text.data import SYSTEM_PROMPT, generate_examples, lcs_ratio, parse_answer

__version__ = "0.1.0"
__all__ = ["ReverseTextHarness", "ReverseTextTaskset"]


def __getattr__(name: str):
    if name in ("ReverseTextHarness", "ReverseTextTaskset", "ReverseTextTask", "ReverseTextData", "ReverseTextConfig"):
        from reverse_text import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'reverse_text' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, generate_examples, lcs_ratio, parse_answer)
