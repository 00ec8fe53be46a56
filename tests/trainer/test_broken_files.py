"""Files of a run that are there but do not read back (cut short by a full disk or a copy, corrupted, edited by hand):
a complete checkpoint the trainer is asked to resume from, a micro-batch file the orchestrator handed over. Each
is one line naming the file (and the checkpoint to resume from instead), never a traceback, never a silent resume
from garbage."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from prime_core.config.shared import CheckpointConfig
from prime_core.io import UnreadableFile
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import read_microbatches
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.world import World
from safetensors.numpy import save_file

from tests.trainer.trainer_utils import train_two_steps_and_fail, write_rollouts


def _flip(path, offset, data=b"\xff" * 8):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


CHANGED = "not what was saved (its checksum differs)"
BREAKS = {
    "data file cut short": ("__0_0.distcp", lambda p: _truncate(p, 100), "cut short: 100 bytes, its index needs "),
    "data file missing": ("__0_0.distcp", lambda p: p.unlink(), "__0_0.distcp: missing"),
    "data file's bytes changed": (
        "__0_0.distcp",
        lambda p: _flip(p, p.stat().st_size // 2),
        f"__0_0.distcp: {CHANGED}",
    ),
    "data file's header overwritten": ("__0_0.distcp", lambda p: _flip(p, 0, b"garbage!"), f"__0_0.distcp: {CHANGED}"),
    "metadata cut short": (".metadata", lambda p: _truncate(p, 500), ".metadata: UnpicklingError"),
    "progress not json": ("progress.json", lambda p: p.write_text("{"), "progress.json: JSONDecodeError"),
    "progress of another schema": ("progress.json", lambda p: p.write_text("[]"), "progress.json: TypeError"),
    "rng state cut short": ("rng/rank_0.pt", lambda p: _truncate(p, 10), f"rng/rank_0.pt: {CHANGED}"),
    "checksums not json": ("checksums.json", lambda p: p.write_text("{"), "checksums.json: JSONDecodeError"),
}


@pytest.fixture
def saved(tmp_path, one_rank_group):
    """Checkpoints 1 and 2 of a small model and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    manager = CheckpointManager(CheckpointConfig(interval=1), RunDir(tmp_path), world)
    for step in (1, 2):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        manager.save(step, model, optimizer, {"data_step": step})
    return manager, model, optimizer


@pytest.mark.parametrize("case", list(BREAKS))
def test_a_broken_complete_checkpoint_is_one_line_naming_the_file(saved, case):
    manager, model, optimizer = saved
    name, corrupt, reason = BREAKS[case]
    ckpt = manager.run_dir.trainer_checkpoint(2)
    corrupt(ckpt / name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnreadableFile) as e:
        manager.load(2, model, optimizer)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"checkpoint step 2 does not load: {ckpt}/"), line
    assert reason in line and line.endswith("(--ckpt.resume-step 1 resumes from the one before)"), line
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # found before anything loaded
    assert manager.load(1, model, optimizer)["data_step"] == 1  # the earlier one still resumes


def test_a_checkpoint_records_the_process_that_saved_it(saved):
    """So that ``sft`` never resumes an RL trainer's checkpoint, nor the trainer an SFT run's (checked at parse)."""
    manager, _, _ = saved
    progress = json.loads((manager.run_dir.trainer_checkpoint(2) / "progress.json").read_text())
    assert progress["process"] == "trainer" and progress["step"] == 2


def test_a_cut_micro_batch_file_is_one_line_naming_it(tmp_path):
    write_rollouts(tmp_path, steps=1, num_ranks=1)
    path = RunDir(tmp_path).rollout_file(0, 0)
    whole = path.read_bytes()
    for size in (3, 300, len(whole) - 10):
        path.write_bytes(whole[:size])
        with pytest.raises(UnreadableFile, match=rf"^{path}: unreadable micro-batch file \(SafetensorError: "):
            read_microbatches(path)


def test_a_micro_batch_file_of_another_schema_is_one_line_naming_it(tmp_path):
    path = tmp_path / "rank_0.safetensors"
    meta = {"schema_version": 1, "step": 0, "rank": 0, "num_micro_batches": 1, "seq_len": 4}
    save_file({"0.input_ids": np.zeros((1, 4), np.int64)}, str(path), metadata={"prime": json.dumps(meta)})
    with pytest.raises(UnreadableFile, match=rf"^{path}: unreadable micro-batch file \(KeyError: missing '0\."):
        read_microbatches(path)
    save_file({"x": np.zeros(1)}, str(path), metadata={"prime": json.dumps({**meta, "step": "zero"})})
    with pytest.raises(UnreadableFile, match=rf"^{path}: meta field 'step' is 'zero': Input should be a valid integer"):
        read_microbatches(path)


def test_the_trainer_names_the_step_and_file_of_a_cut_micro_batch_file(tiny_model_dir, tmp_path):
    write_rollouts(tmp_path, steps=2, num_ranks=1)
    path = RunDir(tmp_path).rollout_file(1, 0)
    path.write_bytes(path.read_bytes()[:300])
    last = train_two_steps_and_fail(tiny_model_dir, tmp_path)
    assert last.startswith(f"error: step 1: rollouts for rank 0: {path}: unreadable micro-batch file ("), last


class Killed(BaseException):
    """The process stopping part-way through a delete (SIGKILL, a power cut)."""


def killed_mid_delete(monkeypatch, name: str):
    """``shutil.rmtree`` of a directory called ``name`` deletes its data files, then the process "dies"."""
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name != name:
            return real(path, *args, **kwargs)
        for f in Path(path).rglob("*.distcp"):
            f.unlink()
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_a_stop_while_old_checkpoints_are_deleted_never_leaves_one_marked_complete(saved, monkeypatch):
    manager, model, optimizer = saved
    manager.config = CheckpointConfig(interval=1, keep=1)
    killed_mid_delete(monkeypatch, "step_1")  # an old step goes whole: trainer and orchestrator parts
    with pytest.raises(Killed):
        manager.save(3, model, optimizer, {"data_step": 3})
    assert manager.saved_steps() == [2, 3] and 1 not in manager.run_dir.checkpoint_steps()


def test_a_stop_while_a_checkpoint_is_saved_again_never_leaves_it_marked_complete(saved, monkeypatch):
    manager, model, optimizer = saved
    killed_mid_delete(monkeypatch, "trainer")
    with pytest.raises(Killed):
        manager.save(2, model, optimizer, {"data_step": 2})  # a resumed run saving the stopped run's step again
    assert manager.saved_steps() == [1]


def test_a_micro_batch_file_whose_bytes_changed_after_the_write_is_refused(tmp_path):
    """The fault benchmarks/chaos.py injects (the newest rollouts file corrupted in place): an advantage changed to a finite
    float passed every check and the trainer trained on it. Now the file's CRC-32 (written beside its meta) is checked
    on read; a file of an older writer, without one, still reads."""
    write_rollouts(tmp_path, steps=1, num_ranks=1)
    path = RunDir(tmp_path).rollout_file(0, 0)
    _, before = read_microbatches(path)
    whole = path.read_bytes()
    header_len = int.from_bytes(whole[:8], "little")
    start = 8 + header_len + json.loads(whole[8 : 8 + header_len])["0.advantages"]["data_offsets"][0]
    _flip(path, start, np.float32(123.0).tobytes())
    with pytest.raises(
        UnreadableFile, match=rf"^{path}: its data changed after it was written \(CRC-32 \w+, written as "
    ):
        read_microbatches(path)
    header = json.loads(whole[8 : 8 + header_len])
    del header["__metadata__"]["prime_crc32"]
    _, older = read_microbatches(_rewrite_header(path, whole, header))
    assert np.array_equal(older[0].advantages, before[0].advantages)


def _rewrite_header(path: Path, whole: bytes, header: dict) -> Path:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + int.from_bytes(whole[:8], "little")
    path.write_bytes(len(text).to_bytes(8, "little") + text + whole[start:])
    return path
