"""``--resume`` from a checkpoint whose small files were replaced by something that is not a file: a FIFO (left by a
user, a tool, a copy of the directory that kept it) or a link to a device. ``open`` of a FIFO waits for a writer that
never comes: the trainer hung at start, on every rank, with nothing in its log. Each load below is bounded by the test
(``SIGALRM``, which interrupts the blocked ``open``) so that a hang is a failure, not a stuck suite."""

import json
import os
import signal
from contextlib import contextmanager

import pytest
from prime_core.io import UnreadableFile
from prime_core.preflight import check_resume_step

from tests.trainer.test_hostile_checkpoint import _manager, _model


class StillWaiting(Exception):
    pass


@contextmanager
def bounded(seconds: int = 60):
    def expire(signum, frame):
        raise StillWaiting(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    except StillWaiting as e:
        pytest.fail(str(e))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def saved(tmp_path, one_rank_group):
    manager = _manager(tmp_path / "run")
    manager.save(1, *_model(), {"data_step": 1})
    return manager, manager.run_dir.trainer_checkpoint(1)


def _plant(path, kind):
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")


# A link to /dev/zero (read whole until memory ran out, before) is `read_regular`'s test in tests/core: here it would
# take the test process down with the old code.
@pytest.mark.parametrize("kind", ["fifo"])
# checksums.json: before, a FIFO there read as "no checksums" (a check by path), and the check was skipped.
@pytest.mark.parametrize("name", ["progress.json", ".metadata", "checksums.json"])
def test_a_fifo_in_a_checkpoint_is_one_line_not_a_hang(saved, name, kind):
    manager, ckpt = saved
    _plant(ckpt / name, kind)
    with bounded(), pytest.raises(UnreadableFile) as e:
        manager.load(1, *_model())
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"checkpoint step 1 does not load: {ckpt}/{name}: "), line
    assert "not a regular file" in line and line.count(f"{ckpt}/{name}") == 1, line


@pytest.mark.parametrize("kind", ["fifo"])
def test_the_resume_preflight_leaves_a_fifo_progress_record_to_the_trainer(saved, kind):
    """The parse-time check (``check_resume_step``, run by ``rl`` and the trainer before torch starts) read
    ``progress.json`` too, and hung there first."""
    manager, ckpt = saved
    assert json.loads((ckpt / "progress.json").read_text())["process"] == "trainer"
    _plant(ckpt / "progress.json", kind)
    with bounded():
        assert check_resume_step(manager.run_dir.root, 1, "trainer") is None


def test_an_oversized_progress_record_is_one_line_and_not_read(saved):
    """A sparse file of 16 MiB and one byte at ``progress.json``: refused by its size, before, read whole."""
    manager, ckpt = saved
    os.truncate(ckpt / "progress.json", (16 << 20) + 1)
    with pytest.raises(UnreadableFile) as e:
        manager.load(1, *_model())
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        f"checkpoint step 1 does not load: {ckpt}/progress.json: over 16777216 bytes"
    ), line
