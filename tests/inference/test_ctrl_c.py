"""Ctrl-C of ``inference`` on its own: one line and exit 130 in every phase. Before: a KeyboardInterrupt traceback and
death by SIGINT (exit -2) in each; during the model's load, after the load had ended (4-9 s on the tiny CPU model).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "reverse_text" / "model"


def _interrupted_after(line: str, tmp_path: Path, settle_s: float = 0.0) -> tuple[int, float, list[str]]:
    """Start ``inference`` on the tiny model, send SIGINT ``settle_s`` after its output shows ``line``; the exit code,
    the seconds from the signal to the exit and the output's lines."""
    cmd = [str(Path(sys.executable).parent / "inference"), "--model.name", str(MODEL), "--engine", "torch",
           "--output-dir", str(tmp_path), "--server.port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for out in proc.stdout:
        lines.append(out.rstrip("\n"))
        if line in out:
            break
    time.sleep(settle_s)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
    return proc.returncode, time.monotonic() - began, lines + rest.splitlines()


def test_ctrl_c_while_the_model_loads_ends_at_once_in_one_line(tmp_path):
    code, took, lines = _interrupted_after("Waiting for application startup.", tmp_path)
    assert (code, lines[-1]) == (130, f"inference: interrupted (SIGINT) while loading {MODEL}; nothing was served")
    assert took < 2.5, took  # before: the rest of the load (4-9 s here)
    assert not any("Traceback" in line for line in lines), lines


@pytest.mark.slow
def test_ctrl_c_of_a_serving_server_is_one_line(tmp_path):
    code, took, lines = _interrupted_after(
        "Uvicorn running on", tmp_path, settle_s=0.5
    )  # it logs, then counts as started
    assert (code, lines[-1]) == (130, f"inference: interrupted (SIGINT); stopped serving {MODEL}")
    assert not any("Traceback" in line for line in lines), lines


def test_ctrl_c_before_anything_runs_is_one_line():
    """What the entry points wrap their parsing and imports in (`prime_core.early_sigint`)."""
    code = (
        "import os, signal, time\nfrom prime_core.early_sigint import ends_on_sigint\n"
        # as at a terminal: a shell's background job (CI's, maybe) starts with SIGINT ignored, which stays ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "with ends_on_sigint('tool: interrupted (SIGINT) while starting'):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stderr) == (130, "tool: interrupted (SIGINT) while starting\n")
