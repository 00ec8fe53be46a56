"""The training loop shown in docs/models.md runs, and the doc embeds it verbatim."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "packages/prime-models/examples/train_loop.py"


def test_train_loop_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "step 15 loss" in capsys.readouterr().out


def test_docs_embed_the_example():
    assert EXAMPLE.read_text().strip() in (ROOT / "docs/models.md").read_text()
