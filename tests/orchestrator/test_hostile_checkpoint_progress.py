"""``--ckpt.resume-step`` with the orchestrator's ``progress.json`` missing from a complete checkpoint, or replaced by
a FIFO: before, a ``FileNotFoundError`` the entry point does not catch (a traceback); now an `UnreadableFile`, which
it prints as one line (exit 1)."""

import os
from types import SimpleNamespace

import pytest
from prime_core.io import UnreadableFile, mark_stable
from prime_core.run_dir import RunDir
from prime_orchestrator.orchestrator import Orchestrator


@pytest.mark.parametrize("kind", ["fifo", "missing"])
def test_an_orchestrator_checkpoint_without_a_readable_progress_record_is_one_line(tmp_path, kind):
    run_dir = RunDir(tmp_path)
    ckpt = run_dir.orchestrator_checkpoint(2)
    ckpt.mkdir(parents=True)
    mark_stable(ckpt)
    if kind == "fifo":
        os.mkfifo(ckpt / "progress.json")
    why = "not a regular file" if kind == "fifo" else "missing"
    with pytest.raises(UnreadableFile, match=rf"^{ckpt}/progress\.json: {why} \(a checkpoint's\)$"):
        Orchestrator._load_checkpoint(SimpleNamespace(run_dir=run_dir), 2)
