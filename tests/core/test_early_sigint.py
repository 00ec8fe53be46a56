"""Ctrl-C of ``trainer``, ``sft`` and ``eval`` while they parse and import (torch, verifiers: seconds): one line and exit
130. Before: a KeyboardInterrupt traceback from inside whichever import it landed in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "reverse_text" / "model"

# The signal arrives as the entry point starts importing its first heavy package, the moment a user's Ctrl-C lands in.
_INTERRUPT_AT_IMPORT = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a shell's background job ignores it)
class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "verifiers"):
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Interrupt())
from {module} import main
main({argv!r})
"""


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        ("prime_trainer.entrypoints.trainer", ["--model.name", str(MODEL), "--data.fake.batch-size", "1"], "trainer"),
        ("prime_trainer.entrypoints.sft", ["--model.name", str(MODEL), "--data.fake.batch-size", "1"], "sft"),
        (
            "prime_orchestrator.entrypoints.eval",
            ["--model.name", str(MODEL), "--environment-ids", "reverse-text"],
            "eval",
        ),
    ],
)
def test_ctrl_c_while_starting_is_one_line(tmp_path, module, argv, line):
    argv = [*argv, "--output-dir", str(tmp_path / "run")]
    code = _INTERRUPT_AT_IMPORT.format(module=module, argv=argv)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 130, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith(f"{line}: interrupted (SIGINT) while starting"), result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
