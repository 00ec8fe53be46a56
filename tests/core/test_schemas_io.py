"""prime-core's hand-off formats: micro-batch files, atomic directories, run dir, metrics."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re

import numpy as np
import pytest
from prime_core.io import atomic_dir, atomic_write_json, is_stable, wait_for_path
from prime_core.monitor import JsonlMonitor, read_metrics
from prime_core.run_dir import RunDir
from prime_core.schemas import MicroBatch, RolloutBatchMeta, WeightUpdateRequest, read_microbatches, write_microbatches
from prime_core.schemas.microbatch import MICROBATCH_FIELDS, read_microbatch_meta


def make_microbatch(rows: int, seq_len: int, seed: int) -> MicroBatch:
    rng = np.random.default_rng(seed)
    return MicroBatch(
        input_ids=rng.integers(0, 100, (rows, seq_len)),
        position_ids=np.tile(np.arange(seq_len), (rows, 1)),
        loss_mask=rng.random((rows, seq_len)) > 0.5,
        advantages=rng.standard_normal((rows, seq_len)).astype(np.float32),
        inference_logprobs=-rng.random((rows, seq_len)).astype(np.float32),
        sample_ids=np.zeros((rows, seq_len), dtype=np.int64),
    )


def required_fields(mb: MicroBatch) -> dict[str, np.ndarray]:
    return {name: getattr(mb, name) for name in MICROBATCH_FIELDS}


def test_microbatch_file_round_trip(tmp_path):
    mbs = [make_microbatch(2, 16, 0), make_microbatch(2, 16, 1)]
    meta = RolloutBatchMeta(step=3, rank=1, num_micro_batches=2, seq_len=16, temperature=0.7, global_loss_tokens=40)
    path = RunDir(tmp_path).rollout_file(3, 1)
    write_microbatches(path, meta, mbs)
    got_meta, got = read_microbatches(path)
    assert got_meta == meta
    for a, b in zip(mbs, got, strict=True):
        for name in ["input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "sample_ids"]:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert b.loss_mask.dtype == np.bool_
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_microbatch_rejects_bad_shapes_and_versions(tmp_path):
    with pytest.raises(ValueError, match="loss_mask"):
        MicroBatch(
            input_ids=np.zeros((1, 4)),
            position_ids=np.zeros((1, 4)),
            loss_mask=np.zeros((1, 5)),
            advantages=np.zeros((1, 4)),
            inference_logprobs=np.zeros((1, 4)),
            sample_ids=np.zeros((1, 4)),
        )
    from safetensors.numpy import save_file

    path = tmp_path / "old.safetensors"
    save_file({"x": np.zeros(1)}, str(path), metadata={"prime": json.dumps({"schema_version": 999})})
    with pytest.raises(ValueError, match="schema version 999"):
        read_microbatch_meta(path)


@pytest.mark.parametrize(
    ("field", "dtype"), [("input_ids", np.float32), ("loss_mask", np.float32), ("inference_logprobs", np.int64)]
)
def test_a_micro_batch_file_with_a_field_of_another_dtype_is_refused_not_cast(tmp_path, field, dtype):
    """Written by another tool (or edited): token ids as floats (1.7 would train as token 1), a loss mask of 0.5s (as
    all ones), log-probs truncated to integers. The file is one line naming the field, never cast silently."""
    from prime_core.io import UnreadableFile
    from prime_core.schemas.microbatch import microbatch_tensors
    from safetensors.numpy import save_file

    meta = RolloutBatchMeta(step=0, rank=0, num_micro_batches=1, seq_len=8)
    tensors = microbatch_tensors(0, make_microbatch(2, 8, 0))
    tensors[f"0.{field}"] = (tensors[f"0.{field}"] + 0.7).astype(dtype)
    path = tmp_path / "rank_0.safetensors"
    save_file(tensors, str(path), metadata={"prime": meta.model_dump_json()})
    stored = "uint8" if field == "loss_mask" else np.dtype(MICROBATCH_FIELDS[field]).name
    line = f"{path}: unreadable micro-batch file (ValueError: micro-batch 0 field '{field}' is {np.dtype(dtype).name}, "
    with pytest.raises(UnreadableFile, match=rf"^{re.escape(line)}written as {stored}\)$"):
        read_microbatches(path)


def test_empty_microbatch_has_no_loss_tokens():
    mb = MicroBatch.empty(2, 8)
    assert mb.num_loss_tokens == 0 and (mb.sample_ids == -1).all()


def test_extra_per_token_arrays_round_trip_stack_and_pad(tmp_path):
    from prime_core.schemas.microbatch import stack_rows

    extra = {"teacher_logprobs": -np.arange(16, dtype=np.float32).reshape(2, 8), "token_class": np.ones((2, 8))}
    mb = MicroBatch(**required_fields(make_microbatch(2, 8, 0)), extra=extra)
    path = tmp_path / "mb.safetensors"
    write_microbatches(path, RolloutBatchMeta(step=0, rank=0, num_micro_batches=1, seq_len=8), [mb])
    got = read_microbatches(path)[1][0]
    assert got.extra.keys() == {"teacher_logprobs", "token_class"}
    np.testing.assert_array_equal(got.extra["teacher_logprobs"], mb.extra["teacher_logprobs"])
    assert got.extra["teacher_logprobs"].dtype == np.float32 and got.extra["token_class"].dtype == np.float64
    # Padding keeps the names (every micro-batch a loss sees has them), with zeros; rows without one get zeros too.
    pad = MicroBatch.empty(1, 8, got.extra_dtypes)
    assert pad.extra_dtypes == got.extra_dtypes and not pad.extra["teacher_logprobs"].any()
    stacked = stack_rows([got, MicroBatch.empty(1, 8)])
    assert stacked.extra["teacher_logprobs"].shape == (3, 8) and not stacked.extra["teacher_logprobs"][2].any()
    np.testing.assert_array_equal(stacked.extra["teacher_logprobs"][:2], mb.extra["teacher_logprobs"])


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("ok", np.zeros((2, 7)), r"extra 'ok' has shape \(2, 7\), expected \(2, 8\)"),
        ("ok", np.array([["a"] * 8] * 2), "must hold integers or floats"),
        ("has.dot", np.zeros((2, 8)), "extra name 'has.dot' must match"),
    ],
)
def test_extra_arrays_are_checked_per_token(name, value, message):
    with pytest.raises(ValueError, match=message):
        MicroBatch(**required_fields(make_microbatch(2, 8, 0)), extra={name: value})


def test_atomic_dir_publishes_complete_directories_only(tmp_path):
    target = tmp_path / "weights" / "step_1"
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("writer crashed")
    assert not target.exists() and list((tmp_path / "weights").iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_bytes(b"full")
        assert not target.exists()
    assert is_stable(target) and (target / "model.safetensors").read_bytes() == b"full"
    assert RunDir(tmp_path).stable_weight_steps() == [1]


def test_wait_for_path_times_out_with_the_path_in_the_message(tmp_path):
    with pytest.raises(TimeoutError, match="never.json"):
        wait_for_path(tmp_path / "never.json", timeout=0.1)
    atomic_write_json(tmp_path / "now.json", {"a": 1})
    assert wait_for_path(tmp_path / "now.json", timeout=1).exists()


def _append(path, process, n):
    monitor = JsonlMonitor(path, process)
    for step in range(n):
        monitor.log(step, {"loss/mean": float(step), "note": "x" * 2000})


def test_jsonl_monitor_lines_stay_whole_under_concurrent_writers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    procs = [mp.get_context("fork").Process(target=_append, args=(path, name, 200)) for name in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    records = read_metrics(path)
    assert len(records) == 400 and len(path.read_text().splitlines()) == 400
    assert [r.step for r in read_metrics(path, "a")] == list(range(200))


def test_weight_update_request_is_closed():
    assert WeightUpdateRequest(weight_dir="/x", step=2).step == 2
    with pytest.raises(ValueError):
        WeightUpdateRequest.model_validate({"weight_dir": "/x", "extra": 1})


def test_run_dir_layout(tmp_path):
    run = RunDir(tmp_path)
    assert run.rollout_file(2, 0) == tmp_path / "rollouts" / "step_2" / "rank_0.safetensors"
    assert run.trainer_checkpoint(4) == tmp_path / "checkpoints" / "step_4" / "trainer"
    assert run.log_file("trainer") == tmp_path / "logs" / "trainer.log"
    assert run.metrics == tmp_path / "metrics.jsonl"
    assert not os.path.exists(tmp_path / "rollouts")
