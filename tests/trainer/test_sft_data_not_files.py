"""SFT data paths where something other than a file sits under a data file's name: a FIFO (a user's pipe, a tool that
streams a dataset) blocked the trainer in ``open`` for good, before any message. Each read is bounded by the test
(``SIGALRM`` interrupts the blocked ``open``), so a hang is a failure. A link to ``/dev/zero`` (read without end,
until memory ran out, before) is refused by the same check; it is left out here, where the old code would take the
test process down with it."""

import json
import os
import signal

import pytest
from prime_core.config import ConfigError
from prime_trainer.sft.rows import load_rows


@pytest.fixture
def bounded():
    def expire(signum, frame):
        raise TimeoutError("still waiting after 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_among_the_data_files_of_a_directory_is_named(tmp_path, bounded):
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "ab", "completion": "ba"}) + "\n")
    os.mkfifo(tmp_path / "b.jsonl")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/b\.jsonl: not a regular file \(a data file is one\)$"):
        load_rows(str(tmp_path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_a_fifo_given_as_the_data_file_is_named(tmp_path, bounded, suffix):
    path = tmp_path / f"train{suffix}"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match=rf"^{path}: not a regular file \(a data file is one\)$"):
        load_rows(str(path))
