"""``read_metrics`` (the launcher's summary, ``prime-launch report``) and ``MetricsTail`` (the launcher's live line)
read metrics.jsonl with bounds: a file over `METRICS_BYTES` is refused by its size, a line over
`METRICS_LINE_BYTES` is skipped without being held, one tail read takes at most `TAIL_READ_BYTES`, and a FIFO in the
file's place is one line. Before, both read whatever was there whole: one 512 MiB line (a sparse file) took 1 GiB of
memory and 3 s in one call, and the tail kept the unfinished line and copied it on every poll.

The real bounds are GiB and MiB: the tests shrink them, so that what the code before read stays cheap."""

from __future__ import annotations

import logging
import os
import tracemalloc
from types import SimpleNamespace

import pytest
from prime_core import monitor
from prime_core.io import UnreadableFile
from prime_core.monitor import MetricsTail, read_metrics
from prime_core.schemas.metrics import MetricsRecord


def _record(step: int, process: str = "trainer") -> bytes:
    return (MetricsRecord(step=step, process=process, values={"loss/mean": 1.0}).model_dump_json() + "\n").encode()


def _bytes_read() -> int:
    """What this process read through read(2) so far (``rchar``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _peak_while(fn):
    """``fn()`` and the most memory Python held meanwhile (tracemalloc counts the bytes objects a read makes)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_metrics_file_over_the_bound_is_one_line_and_not_read(tmp_path, monkeypatch):
    limit = 1 << 20
    monkeypatch.setattr(monitor, "METRICS_BYTES", limit)
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        f.write(_record(0))
        f.truncate(limit + 1)  # sparse: costs nothing to make
    before = _bytes_read()
    with pytest.raises(UnreadableFile) as e:
        read_metrics(path)
    assert _bytes_read() - before < 64 << 10
    assert str(e.value) == f"{path}: over {limit} bytes ({limit + 1}), too large for a metrics file"


def test_an_over_long_line_is_skipped_without_being_held(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "METRICS_LINE_BYTES", 64 << 10)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_record(0) + b"x" * (4 << 20) + b"\n" + _record(1) + b"y" * (4 << 20))  # the last one torn
    records, peak = _peak_while(lambda: read_metrics(path))
    assert [r.step for r in records] == [0, 1]
    assert peak < 1 << 20, f"held {peak} bytes reading lines of 4 MiB"


def test_a_fifo_is_refused_by_the_summary_in_one_line_and_the_run_report_stands(tmp_path):
    """``rl``'s closing summary names the file and goes on (the run's outcome is already decided)."""
    from prime_core.run_dir import RunDir
    from prime_launch.launcher import _report

    os.mkfifo(tmp_path / "metrics.jsonl")
    said: list[str] = []
    plan = SimpleNamespace(runs={}, run_dir=RunDir(tmp_path))
    _report(plan, SimpleNamespace(message=said.append), succeeded=False)
    assert said == [f"rl: no summary: {tmp_path / 'metrics.jsonl'}: not a regular file (a metrics file is one)"]


def test_the_tail_reads_a_backlog_over_several_calls(tmp_path, monkeypatch):
    """A resumed run's file is caught up a bounded piece per poll, in order, every record once."""
    monkeypatch.setattr(monitor, "TAIL_READ_BYTES", 4096)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_record(step) for step in range(200)))
    tail, steps, calls = MetricsTail(path), [], 0
    while len(steps) < 200:
        before = _bytes_read()
        got = tail.read()
        assert _bytes_read() - before <= 4096 + 1024  # the piece, and the stat of the open
        steps += [r.step for r in got]
        calls += 1
        assert calls < 200, "the tail stopped advancing"
    assert steps == list(range(200)) and calls > 1 and tail.read() == []


def test_the_tail_drops_an_over_long_unfinished_line_and_reads_on(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "METRICS_LINE_BYTES", 64 << 10)
    monkeypatch.setattr(monitor, "TAIL_READ_BYTES", 256 << 10)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_record(0) + b"x" * (4 << 20))  # a line being written that never ends (garbage)
    tail = MetricsTail(path)
    got, peak = _peak_while(lambda: [r.step for _ in range(20) for r in tail.read()])
    assert got == [0] and peak < 2 << 20, f"held {peak} bytes"  # before, the 4 MiB line was held and copied
    with open(path, "ab") as f:
        f.write(b"x\n" + _record(1))
    assert [r.step for r in tail.read()] == [1]


def test_the_tail_follows_a_file_replaced_by_a_shorter_one_from_its_start(tmp_path):
    """``rl --resume`` rewrites metrics.jsonl without the redone steps: before, the tail's offset lay past the new
    file's end and it read nothing more."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_record(step) for step in range(5)))
    tail = MetricsTail(path)
    assert len(tail.read()) == 5
    (tmp_path / "new").write_bytes(_record(0) + _record(1))
    os.replace(tmp_path / "new", path)
    assert [r.step for r in tail.read()] == [0, 1]


def test_the_tail_refuses_a_fifo_with_one_warning_and_never_waits(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    tail = MetricsTail(path)
    with caplog.at_level(logging.WARNING, logger="prime_core.monitor"):
        assert tail.read() == [] and tail.read() == []
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: not a regular file (a metrics file is one); no metrics are shown"
    ]
