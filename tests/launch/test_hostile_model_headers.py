"""The launcher reads the model's safetensors headers to size the run (`prime_launch.host.safetensors_params`). A
downloaded directory may hold anything under those names; the count gives up (None, as without weights) instead of
reading a claimed length of gigabytes into memory or blocking on a FIFO."""

import os
import struct
import tracemalloc

import pytest
from prime_launch.host import SAFETENSORS_MAX_HEADER, safetensors_params


def test_a_header_length_of_hundreds_of_megabytes_is_not_read(tmp_path):
    claimed = 3 * SAFETENSORS_MAX_HEADER
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", claimed))
        f.truncate(8 + claimed)  # sparse: the file is as long as it claims, all zeros
    tracemalloc.start()
    try:
        assert safetensors_params(tmp_path) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # the old reader held the claimed 300 MB at once


@pytest.mark.timeout(120)  # a guard only: the old reader blocked in open() for ever
def test_a_fifo_under_a_shard_name_is_not_opened(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    assert safetensors_params(tmp_path) is None
