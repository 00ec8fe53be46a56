"""Resuming SFT with other data than the checkpoint's (data.path edited or replaced, seq_len, shuffle or seed changed):
the saved data position (epoch, packed rows consumed) indexes other rows, so the resumed run skips and repeats rows
that are not those of the run it continues. That went without a word; it is one warning naming what changed."""

import logging

import numpy as np
from prime_trainer.sft.data import PackedData, Sample


def _samples(n: int, length: int = 5) -> list[Sample]:
    return [Sample(np.arange(length, dtype=np.int64) + i, np.ones(length, dtype=np.bool_)) for i in range(n)]


def _consumed(data: PackedData) -> dict:
    for _ in range(3):
        data.next_batch(0, 1)
    return data.state()


def test_other_data_at_resume_is_one_warning_naming_what_changed(caplog):
    state = _consumed(PackedData(_samples(40), 16, 4, 1, True, 0))
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        PackedData(_samples(30), 16, 4, 1, True, 0).load_state(state)
        PackedData(_samples(40), 32, 4, 1, True, 1).load_state(state)
    first, second = [r.getMessage() for r in caplog.records]
    assert "samples 40 -> 30" in first and "epoch 0, row 12" in first, first
    assert "seq_len 16 -> 32" in second and "seed 0 -> 1" in second and "samples" not in second, second


def test_the_same_data_and_an_old_state_resume_without_a_warning(caplog):
    state = _consumed(PackedData(_samples(40), 16, 4, 1, True, 0))
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        resumed = PackedData(_samples(40), 16, 4, 1, True, 0)
        resumed.load_state(state)
        PackedData(_samples(30), 16, 4, 1, True, 0).load_state({"epoch": 0, "cursor": 12})  # saved before the record
    assert caplog.records == [] and resumed.state() == state
