"""Limits on the shape of the code, checked on every package's source: modules of at most 500 lines, functions of
at most 60 lines, and no import cycles between modules (an import inside a function counts: it still ties the two
modules together). The package direction is held by tests/test_dependency_direction.py.

Each failure names the file, the function or the modules, and the limit. Fix the code rather than the limit: split a
long function into the steps it reads as, move what two modules share into a third.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def source_files() -> list[Path]:
    return sorted(ROOT.glob("packages/*/src/**/*.py"))


def _src_root(path: Path) -> Path:
    """``packages/<pkg>/src``: the directory module names are relative to."""
    return ROOT / Path(*path.relative_to(ROOT).parts[:3])


def modules() -> dict[str, Path]:
    found = {}
    for path in source_files():
        parts = list(path.relative_to(_src_root(path)).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its qualified name (``Class.method``, ``outer.inner``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Workspace modules ``name`` imports anywhere in its file (``from pkg import module`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of modules (Tarjan), each sorted; [] when the import graph is acyclic."""
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_modules_stay_under_the_line_limit():
    long = []
    for path in source_files():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_MODULE_LINES})")
    assert not long, "modules over the limit: split them by what they own\n" + "\n".join(long)


def test_functions_fit_on_a_screen():
    long = []
    for path in source_files():
        for qualname, node in functions(ast.parse(path.read_text(), filename=str(path))):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                long.append(f"{where} {qualname}() has {lines} lines (limit {MAX_FUNCTION_LINES})")
    assert not long, "functions over the limit: split them into the steps they read as\n" + "\n".join(long)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles (move what the modules share into a module both import):\n" + "\n".join(
        " <-> ".join(group) for group in cycles
    )


def test_the_cycle_finder_sees_lazy_and_relative_imports(tmp_path):
    known = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p": tmp_path / "__init__.py"}
    known["p.a"].write_text("def f():\n    from p.b import g\n")
    known["p.b"].write_text("from . import a\nimport p\n")
    assert imports_of("p.a", known["p.a"], known) == {"p.b"}
    assert imports_of("p.b", known["p.b"], known) == {"p.a", "p"}
