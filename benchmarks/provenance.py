"""Which code a benchmark record measured."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_commit(explicit: str | None = None, root: Path = ROOT) -> str:
    """The commit a record is of: ``explicit`` (``--commit`` / ``PRIME_COMMIT``), else the short HEAD of the
    checkout ``root`` is (the directory holding ``benchmarks/``), else ``"unknown"``. An exported copy of the tree
    (the device machine's, a tarball) is no checkout: git would answer with the HEAD of whatever repository encloses
    it, which is not the code that ran."""
    if explicit:
        return explicit
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
            return "unknown"
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() or "unknown"


def add_record(out: Path, label: str | None, record: dict) -> None:
    """Keep ``record`` in the JSON file ``out`` (an object of label -> record) under ``label``, else its commit: a
    record of another host or commit in the same file stays."""
    import json

    results = json.loads(out.read_text()) if out.exists() else {}
    results[label or record["commit"]] = record
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
