"""The orchestrator's read of the model's ``config.json`` (its vocabulary size, to check sampled ids): a FIFO under
the name (a shared or downloaded model directory) blocked the orchestrator in ``open`` for good."""

import os
import subprocess
import sys
import textwrap

import pytest


def test_a_fifo_at_config_json_reads_as_no_vocabulary_size(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    code = textwrap.dedent(f"""
        from prime_orchestrator.sample_checks import vocab_size
        print(vocab_size({str(tmp_path)!r}))
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("vocab_size was still waiting after 60 s (killed)")
    assert proc.stdout.strip() == "None", proc.stderr[-2000:]
