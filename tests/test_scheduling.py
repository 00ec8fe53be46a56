"""The CPU suite's start order under xdist (tests/scheduling.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field

from tests.scheduling import LONGEST, ROOT, start_rank


@dataclass
class Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_the_longest_test_then_groups_then_integration_tests_then_the_rest_in_collection_order():
    items = [
        Item("tests/core/test_a.py::test_unit"),
        Item("tests/models/test_fsdp.py::test_two_ranks@multiprocess", {"xdist_group"}),
        Item("tests/e2e/test_examples.py::test_cpu_example_runs_two_steps[code]", {"integration"}),
        Item("tests/core/test_b.py::test_unit"),
        Item(LONGEST, {"integration"}),
        Item("tests/sandbox/test_pool.py::test_x@sandbox", {"xdist_group", "integration"}),
        Item("tests/e2e/test_reverse_text.py::test_resume", {"integration"}),
    ]
    ordered = [item.nodeid for item in sorted(items, key=start_rank)]
    assert ordered == [
        LONGEST,
        "tests/models/test_fsdp.py::test_two_ranks@multiprocess",
        "tests/sandbox/test_pool.py::test_x@sandbox",
        "tests/e2e/test_examples.py::test_cpu_example_runs_two_steps[code]",
        "tests/e2e/test_reverse_text.py::test_resume",
        "tests/core/test_a.py::test_unit",
        "tests/core/test_b.py::test_unit",
    ]


def test_the_longest_test_exists_unparametrized_and_ungrouped():
    path, name = LONGEST.split("::")
    tree = ast.parse((ROOT / path).read_text())
    (found,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    decorators = [ast.unparse(d) for d in found.decorator_list]
    assert not any("parametrize" in d or "xdist_group" in d for d in decorators), decorators


def test_xdist_keeps_the_collection_order_of_the_units():
    # Without it, loadgroup sorts its units by test count and the longest test starts wherever that puts it.
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--no-loadscope-reorder" in addopts.split()


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    """`--dist loadgroup` sends a group's tests to one worker (tests/scheduling.py restores the group suffix that
    pytest 9.2 dropped): with 2 workers, six tests of one group all record the same worker."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "import pytest\nfrom tests.scheduling import restore_xdist_groups\n\n"
        "@pytest.hookimpl(trylast=True)\ndef pytest_collection_modifyitems(config, items):\n"
        "    restore_xdist_groups(config, items)\n"
    )
    (tmp_path / "test_group.py").write_text(
        "import os, pathlib, pytest\n\n"
        "@pytest.mark.xdist_group('g')\n@pytest.mark.parametrize('i', range(6))\n"
        "def test_a(i):\n"
        "    pathlib.Path(__file__).with_name(f'ran_{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
           "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len({(tmp_path / f"ran_{i}").read_text() for i in range(6)}) == 1


def test_the_processes_tests_start_keep_their_bytecode():
    """CI's image sets PYTHONDONTWRITEBYTECODE; a process a test starts must still cache what it compiles."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr
