"""Wall times a user will compare against (README.md, the quickstart, each example's README) name the machine they
were measured on: "7-10 min" read as a promise was 19 min on a loaded 2-core host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.doc_commands import REPO

WALL_TIME = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+)? ?(?:min|minutes|hours?)\b|~\d+ ?s\b")
MACHINE = re.compile(r"\bcores?\b|-core\b|GPUs?\b|\bH[12]00\b|\bVM\b|\bhost\b|\bCPU\b")


def user_docs() -> list[Path]:
    return [REPO / "README.md", REPO / "docs" / "quickstart.md", *sorted((REPO / "examples").glob("*/README.md"))]


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each blank-line separated paragraph."""
    found, start, lines = [], 1, []
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        if line.strip():
            start = start if lines else number
            lines.append(line)
        elif lines:
            found.append((start, "\n".join(lines)))
            lines = []
    return found


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_wall_times_name_their_machine(doc: Path):
    unnamed = [
        f"{doc.relative_to(REPO)}:{line}: {m.group(0)!r}"
        for line, text in paragraphs(doc.read_text())
        if not MACHINE.search(text)
        for m in WALL_TIME.finditer(text)
    ]
    assert not unnamed, "wall times without the machine they were measured on:\n" + "\n".join(unnamed)


def test_the_check_sees_times():
    assert WALL_TIME.search("10 min 35 s") and WALL_TIME.search("(~15 s)") and WALL_TIME.search("5-8 min")
    assert MACHINE.search("on a 2-core VM") and not MACHINE.search("on a machine")
