"""A checkpoint's checksums come from the bytes as they are written: a save reads none of its files back, every file
it wrote is summed, and the sums are those of the files on disk (resume checks them there, test_broken_files)."""

import builtins
import io
import json
import zlib
from pathlib import Path

import pytest
import torch
from prime_core.config.shared import CheckpointConfig
from prime_core.run_dir import RunDir
from prime_trainer.ckpt import CHECKSUMS_FILE, CheckpointManager
from prime_trainer.ckpt_sums import CrcFileSystemWriter
from prime_trainer.world import World

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def disk_crc(path: Path) -> str:
    return f"{zlib.crc32(path.read_bytes()):08x}"


@pytest.fixture
def reads(monkeypatch):
    """Every file opened for reading (``open``, ``io.open``, ``Path.open``), as resolved paths."""
    opened: list[Path] = []
    real = io.open

    def spy(file, mode="r", *args, **kwargs):
        if "r" in mode and "+" not in mode and isinstance(file, str | Path):
            opened.append(Path(file).resolve())
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return opened


@pytest.mark.parametrize("save_async", [False, True])
def test_a_save_reads_none_of_its_files_back_and_sums_every_file_it_wrote(tmp_path, one_rank_group, reads, save_async):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(CheckpointConfig(interval=1, save_async=save_async), RunDir(tmp_path), WORLD)
    manager.save(1, model, optimizer, {"data_step": 1})
    manager.wait()
    ckpt = manager.run_dir.trainer_checkpoint(1)
    assert [p for p in reads if p.is_relative_to(tmp_path.resolve() / "checkpoints")] == []

    sums = json.loads((ckpt / CHECKSUMS_FILE).read_text())
    data = sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("__*.distcp"))
    assert data and sorted(sums) == sorted([*data, ".metadata", "rng/rank_0.pt"])
    assert sums == {name: disk_crc(ckpt / name) for name in sums}
    assert manager.load(1, model, optimizer)["data_step"] == 1


def test_a_file_the_stream_did_not_only_append_to_has_no_sum_from_the_writer(tmp_path):
    writer = CrcFileSystemWriter(str(tmp_path))
    with writer.fs.create_stream(tmp_path / "appended", "wb") as f:
        f.write(b"abc")
        f.write(memoryview(torch.arange(5, dtype=torch.int32).numpy()))  # not bytes: summed as its raw bytes
        f.write(memoryview(torch.arange(1 << 20, dtype=torch.int32).numpy()))  # long: summed beside the write
        f.write(b"def")
    with writer.fs.create_stream(tmp_path / "seeked", "wb") as f:
        f.write(b"abc")
        f.seek(0)
        f.write(b"x")
    with writer.fs.create_stream(tmp_path / "renamed.tmp", "wb") as f:
        f.write(b"metadata")
    writer.fs.rename(tmp_path / "renamed.tmp", tmp_path / "renamed")
    assert writer.checksums() == {"appended": disk_crc(tmp_path / "appended"), "seeked": None,
                                  "renamed": disk_crc(tmp_path / "renamed")}  # fmt: skip
