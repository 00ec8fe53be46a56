"""``rl --resume`` (and ``prime-launch rewind``) read the stopped run's ``metrics.jsonl`` whole to set the redone
steps' records aside: now with a bound (``METRICS_BYTES``), refused by its size before any of it is read. Before, a
file of 10 GiB there (a sparse one, another file copied over it) was read into memory and then copied into
``metrics.stopped.jsonl`` as one torn line. ``prime-launch rewind`` printed a traceback for a metrics file it could
not read (a FIFO there); now one line, exit 2, like ``rl``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prime_core.io import UnreadableFile, mark_stable
from prime_core.run_dir import RunDir
from prime_launch import resume
from prime_launch.resume import rewind


def _stopped_run(tmp_path) -> RunDir:
    run = RunDir(tmp_path)
    for path in (run.trainer_checkpoint(2), run.orchestrator_checkpoint(2), run.weight_step(2)):
        path.mkdir(parents=True)
        mark_stable(path)
    mark_stable(run.checkpoint_step(2))
    return run


def _bytes_read() -> int:
    """What this process read through read(2) so far (``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_an_oversized_metrics_file_is_one_line_and_not_read(tmp_path, monkeypatch):
    # The real bound is 4 GiB: a smaller one keeps what the code before this read (the whole file) cheap.
    limit = 1 << 20
    monkeypatch.setattr(resume, "METRICS_BYTES", limit, raising=False)
    run = _stopped_run(tmp_path)
    with open(run.metrics, "wb") as f:
        f.truncate(limit + 1)  # sparse: costs nothing to make
    before = _bytes_read()
    with pytest.raises(UnreadableFile) as e:
        rewind(run, 2)
    read = _bytes_read() - before
    assert str(e.value) == (
        f"{run.metrics}: over {limit} bytes, too large for a metrics file (move it out of {tmp_path} to resume "
        "without it)"
    )
    assert read < 64 << 10, f"read {read} bytes of a file refused by its size"
    assert os.path.getsize(run.metrics) == limit + 1 and not (tmp_path / resume.STOPPED_METRICS).exists()


def test_rewind_names_a_metrics_file_it_cannot_read_in_one_line(tmp_path):
    run = _stopped_run(tmp_path)
    os.mkfifo(run.metrics)
    done = subprocess.run([sys.executable, "-m", "prime_launch.entrypoints.cli", "rewind", "--output-dir",
                           str(tmp_path), "--step", "2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: {run.metrics}: not a regular file (a metrics file is one) (move it out of {tmp_path} to resume "
        "without it)\n"
    )
