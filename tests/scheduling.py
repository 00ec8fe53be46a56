"""The order xdist hands tests out in, and the bytecode of the workspace sources, for the CPU suite on 2 cores.

`--dist loadgroup` with `--no-loadscope-reorder` (pyproject's addopts) gives each worker the next unit of work in
collection order: a test, or a whole `xdist_group` at once. Collected in file order, the `multiprocess` group (every
test that started training processes, the README run included) was one unit of about 30 minutes on one worker while
the other finished everything else and waited; and the longest test could start last. So the longest units start
first: the README run, then the groups (each one unit, however many tests), then the tests that start processes
(`integration`), then the many short unit tests, which fill in the end on both workers.
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

LONGEST = "tests/e2e/test_reverse_text.py::test_readme_run_improves_the_model_as_users_measure_it"
"""The longest test (the README run: about 7 minutes alone on 2 cores). A rename only costs time, and
tests/test_scheduling.py fails on it."""


def start_rank(item: Any) -> int:
    """Sort key (stable): 0 the longest test, 1 a grouped test, 2 an integration test, 3 the rest."""
    if item.nodeid == LONGEST:
        return 0
    if item.get_closest_marker("xdist_group") is not None:
        return 1
    if item.get_closest_marker("integration") is not None:
        return 2
    return 3


def compile_workspace_sources() -> None:
    """Write the bytecode of the workspace's own sources (editable installs, which `uv sync` does not compile) when
    Python is told not to (PYTHONDONTWRITEBYTECODE, as in CI's image): every process a test starts (inference,
    orchestrator, env servers, trainer, for each `rl` run) would compile them again. A fraction of a second."""
    if not sys.dont_write_bytecode:
        return
    for folder in ("packages", "environments"):
        compileall.compile_dir(ROOT / folder, quiet=1)


def children_write_bytecode() -> None:
    """Let the processes tests start write the bytecode they compile, where Python is told not to (CI's image sets
    PYTHONDONTWRITEBYTECODE). verifiers runs each episode of its own harnesses (``null``, ``bash``) as a program in a
    uv environment it syncs without bytecode: every such program compiled openai, httpx and pydantic again, 2.1 s of
    CPU each against 1.2 s with the bytecode of the first one reused (tests/environments/test_vf_eval.py starts 73).
    Only the children change: this process's own flag was read at its start."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def restore_xdist_groups(config: Any, items: list[Any]) -> None:
    """pytest-xdist's loadgroup finds an item's group from a ``@group`` suffix of its node id, which it writes to
    ``item._nodeid``; pytest 9.2 reads node ids from ``item._id``, so the suffix was lost and every group's tests were
    dealt to both workers (sandbox pools of the same uid range then counted each other's processes as leaks). Runs
    after xdist's hook and only where the suffix is missing, so it does nothing where xdist's own write works."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})  # fmt: skip
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")
