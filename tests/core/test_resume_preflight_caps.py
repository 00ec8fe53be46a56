"""The resume preflight (``rl --resume``, a trainer's ``--ckpt.resume-step``) reads the trainer checkpoint's
``progress.json`` for the process and LoRA settings it records: now with a bound, refused by its size before any of it
is read. Before, a file of 10 GiB there (a sparse one, another file copied over it) was read whole into memory by the
launcher's config check, before any process started. An unreadable record is still the trainer's to name (None)."""

import os

from prime_core.io import SMALL_JSON_BYTES, mark_stable
from prime_core.preflight import check_resume_step
from prime_core.run_dir import RunDir


def _bytes_read() -> int:
    """What this process read through read(2) so far (``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_an_oversized_trainer_progress_record_is_not_read_by_the_preflight(tmp_path):
    ckpt = RunDir(tmp_path).trainer_checkpoint(2)
    ckpt.mkdir(parents=True)
    with open(ckpt / "progress.json", "wb") as f:
        f.truncate(SMALL_JSON_BYTES + 1)  # sparse: costs nothing to make
    mark_stable(ckpt)
    before = _bytes_read()
    assert check_resume_step(tmp_path, 2) is None
    read = _bytes_read() - before
    assert read < 64 << 10, f"read {read} bytes of a file refused by its size"


def test_a_progress_record_within_the_bound_is_still_checked(tmp_path):
    ckpt = RunDir(tmp_path).trainer_checkpoint(2)
    ckpt.mkdir(parents=True)
    (ckpt / "progress.json").write_text('{"step": 2, "process": "sft"}')
    mark_stable(ckpt)
    assert check_resume_step(tmp_path, 2).startswith(f"checkpoint step 2 in {tmp_path} was written by sft")
    os.truncate(ckpt / "progress.json", SMALL_JSON_BYTES)  # at the bound: read, and not JSON (the trainer names it)
    assert check_resume_step(tmp_path, 2) is None
