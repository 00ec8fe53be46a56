"""The orchestrator checkpoint's files that a resume reads back (``progress.json``, ``curriculum.json``) are read with
a bound, regular files only. Before, each was read whole into memory and then parsed: a ``curriculum.json`` of 10 GiB
(a sparse file, another file copied over it) took 10 GiB and more in the orchestrator before its first byte was
parsed, and failed on the JSON. Now it is one line naming the file, refused by its size before any of it is read.

A FIFO at ``curriculum.json`` read as "no curriculum state": the resumed run started its curriculum from scratch (a
warning), drawing other examples than the uninterrupted run. Now it is refused like one at ``progress.json``."""

import os
import re

import pytest
from prime_core.io import UnreadableFile
from prime_orchestrator.curriculum import PROGRESS_BYTES, STATE_BYTES, Curriculum
from prime_orchestrator.orchestrator import Orchestrator

from tests.orchestrator.test_curriculum import NUM_EXAMPLES, config


def _bytes_read() -> int:
    """What this process read through read(2) so far (``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _checkpoint(tmp_path, step: int = 2):
    c = config(tmp_path, sampler="difficulty_pool")
    orch = Orchestrator(c)
    orch.curriculum.start(NUM_EXAMPLES)
    orch._save_checkpoint(step)
    resumed = c.model_copy(update={"ckpt": c.ckpt.model_copy(update={"resume_step": step})})
    return orch, orch.run_dir.orchestrator_checkpoint(step), resumed


def test_an_oversized_progress_record_is_one_line_and_not_read(tmp_path):
    orch, ckpt, _ = _checkpoint(tmp_path)
    path = ckpt / "progress.json"
    os.truncate(path, PROGRESS_BYTES + 1)  # sparse past the record: costs nothing to make
    before = _bytes_read()
    with pytest.raises(UnreadableFile) as e:
        orch._load_checkpoint(2)
    read = _bytes_read() - before
    assert str(e.value) == f"{path}: over {PROGRESS_BYTES} bytes, too large for an orchestrator checkpoint"
    assert read < 64 << 10, f"read {read} bytes of a file refused by its size"
    assert orch.start_step == 0


def test_an_oversized_curriculum_state_is_one_line_and_not_read(tmp_path):
    _, ckpt, resumed = _checkpoint(tmp_path)
    path = ckpt / "curriculum.json"
    os.truncate(path, STATE_BYTES + 1)
    before = _bytes_read()
    with pytest.raises(UnreadableFile) as e:
        Curriculum(resumed, NUM_EXAMPLES)
    read = _bytes_read() - before
    assert str(e.value) == f"{path}: over {STATE_BYTES} bytes, too large for a curriculum checkpoint"
    assert read < 64 << 10, f"read {read} bytes of a file refused by its size"


def test_a_fifo_at_the_curriculum_state_is_refused_not_taken_for_none(tmp_path):
    _, ckpt, resumed = _checkpoint(tmp_path)
    path = ckpt / "curriculum.json"
    path.unlink()
    os.mkfifo(path)
    line = f"{path}: not a regular file (a curriculum checkpoint is one)"
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}$"):
        Curriculum(resumed, NUM_EXAMPLES)


def test_checkpoint_files_within_their_bounds_resume_as_before(tmp_path, caplog):
    orch, ckpt, resumed = _checkpoint(tmp_path)
    saved = Curriculum(resumed, NUM_EXAMPLES)
    assert saved.folded_through == orch.curriculum.folded_through and saved.totals == orch.curriculum.totals
    orch._load_checkpoint(2)
    assert orch.start_step == 2
    (ckpt / "curriculum.json").unlink()  # a checkpoint of a run without a curriculum: it starts from scratch
    assert Curriculum(resumed, NUM_EXAMPLES).folded_through == -1
    assert "the curriculum starts from scratch" in caplog.text
