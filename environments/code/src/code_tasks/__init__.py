"""Write a Python function; reward = fraction of its hidden unit tests passed, run in the prime sandbox.

``generate_tasks`` (plain Python, no verifiers import) builds the deterministic tasks, also usable as SFT data
(each carries a reference solution); ``CodeTaskset`` (imported lazily, it needs verifiers) is the environment.
"""

from code_tasks.data import SYSTEM_PROMPT, extract_code, generate_tasks

__version__ = "0.1.0"
__all__ = ["CodeHarness", "CodeTaskset"]


def __getattr__(name: str):
    if name in ("CodeHarness", "CodeTaskset", "CodeTask", "CodeData", "CodeConfig"):
        from code_tasks import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'code_tasks' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, extract_code, generate_tasks)
