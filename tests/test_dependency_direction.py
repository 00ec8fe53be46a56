"""The package dependency direction of DESIGN.md, checked on every import statement in the tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["prime_core", "prime_models", "prime_trainer", "prime_inference", "prime_orchestrator", "prime_launch"]

# package -> workspace packages it may import.
ALLOWED = {
    "prime_core": set(),
    "prime_models": {"prime_core"},
    "prime_trainer": {"prime_core", "prime_models"},
    "prime_inference": {"prime_core", "prime_models"},
    "prime_orchestrator": {"prime_core"},
    "prime_launch": {"prime_core"},
}
# prime_inference may use prime_models only inside its torch engine (extra `torch`).
INFERENCE_MODELS_ONLY_UNDER = "engines"

# Third-party modules a package must never import, even lazily.
FORBIDDEN_THIRD_PARTY = {
    "prime_core": {"torch", "vllm", "transformers"},
    "prime_orchestrator": {"torch", "vllm", "transformers"},
    "prime_launch": {"torch", "vllm", "transformers"},
}


def source_dir(package: str) -> Path:
    return ROOT / "packages" / package.replace("_", "-") / "src" / package


def imported_modules(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted(source_dir(package).rglob("*.py")):
        rel = path.relative_to(source_dir(package))
        for module, line in imported_modules(path):
            top = module.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                bad.append(f"{package}/{rel}:{line} imports {top}")
            if package == "prime_inference" and top == "prime_models" and rel.parts[0] != INFERENCE_MODELS_ONLY_UNDER:
                bad.append(f"{package}/{rel}:{line} imports prime_models outside {INFERENCE_MODELS_ONLY_UNDER}/")
            if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                bad.append(f"{package}/{rel}:{line} imports {top}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_follow_the_dependency_direction(package):
    assert source_dir(package).is_dir()
    assert violations(package) == []


def test_checker_catches_a_violation(tmp_path, monkeypatch):
    fake = tmp_path / "packages" / "prime-core" / "src" / "prime_core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("import torch\nfrom prime_trainer.x import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("prime_core") == [
        "prime_core/bad.py:1 imports torch",
        "prime_core/bad.py:2 imports prime_trainer",
    ]


def _modules_after_import(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _all_submodules(package: str) -> list[str]:
    names = []
    for path in sorted(source_dir(package).rglob("*.py")):
        rel = path.relative_to(source_dir(package)).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts))
    return names


@pytest.mark.parametrize("package", ["prime_core", "prime_orchestrator"])
def test_importing_never_imports_torch(package):
    modules = _all_submodules(package)
    # transport_zmq needs pyzmq only; every module must import without torch/transformers/vllm.
    loaded = _modules_after_import("\n".join(f"import {m}" for m in modules))
    heavy = sorted(m for m in loaded if m.split(".")[0] in {"torch", "vllm", "transformers"})
    assert heavy == []
