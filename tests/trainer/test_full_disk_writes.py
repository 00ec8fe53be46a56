"""A full disk under each file the processes of a run write: the trainer's checkpoint (synchronous and in the
background) and weights, the orchestrator's micro-batch files and checkpoint, metrics.jsonl, the log file. Each
fault is one line naming what was being written and where; the files already complete stay complete (nothing
half-written under a final name, no temporary left), and a metrics line the disk cut short never swallows the next.

The disk is a small tmpfs mounted for the test (root only; the tests skip elsewhere)."""

import logging
import os
import subprocess
import sys

import pytest
import torch
from prime_core.config.shared import CheckpointConfig
from prime_core.io import StorageError, storage_error_line
from prime_core.logging import setup_logging
from prime_core.monitor import JsonlMonitor, read_metrics
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import RolloutBatchMeta
from prime_core.transport import FilesystemSender
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.weights.filesystem import FilesystemPublisher
from prime_trainer.world import World

from tests.trainer.trainer_utils import TINY_QWEN3, make_step_batches

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="mounts a tmpfs (root)")
FULL = "No space left on device (errno 28 ENOSPC)"
WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def disk(tmp_path):
    """Mount a tmpfs of ``size`` KiB at ``tmp_path/disk``; ``fill(leave)`` leaves ``leave`` bytes of it free."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = []

    def mount(size_kib: int):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], check=False)


def fill(path, leave: int = 0) -> None:
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(path / "filler", "wb") as f:
        f.write(bytes(max(free - leave, 0)))


def leftovers(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if ".tmp" in p.name)


def test_micro_batch_files_on_a_full_disk_name_the_step_and_rank(disk):
    out = disk(256)
    sender = FilesystemSender(RunDir(out))
    batches = make_step_batches(3, 4, 2, 32, 96)
    meta = RolloutBatchMeta(step=3, rank=1, num_micro_batches=4, seq_len=32)
    fill(out, leave=4096)
    with pytest.raises(StorageError) as e:
        sender.send(3, 1, meta, batches)
    path = RunDir(out).rollout_file(3, 1)
    assert str(e.value) == f"{FULL} writing rollouts of step 3 for trainer rank 1 to {path}"
    assert not path.exists() and leftovers(out) == []


def test_metrics_on_a_full_disk_name_the_step_and_the_next_line_survives(disk):
    out = disk(64)
    monitor = JsonlMonitor(out / "metrics.jsonl", "trainer")
    monitor.log(0, {"loss": 1.0})
    fill(out, leave=0)
    # The page the first line started has room left: the next line half fits, and a full disk says nothing of it.
    with pytest.raises(StorageError) as e:
        for step in range(1, 100):
            monitor.log(step, {"loss": 1.0, "pad": "x" * 1500})
    assert str(e.value).startswith(f"{FULL} writing metrics of step ") and str(e.value).endswith(
        f"to {out}/metrics.jsonl"
    )
    (out / "filler").unlink()  # the user frees space and resumes: a new process appends
    JsonlMonitor(out / "metrics.jsonl", "trainer").log(7, {"loss": 0.5})
    records = read_metrics(out / "metrics.jsonl")
    assert records[0].step == 0 and records[-1].step == 7 and records[-1].values == {"loss": 0.5}


def test_a_log_file_on_a_full_disk_is_one_line_and_the_console_keeps_every_line(disk, capsys):
    out = disk(64)
    fill(out, leave=0)
    try:
        log = setup_logging("trainer", log_file=out / "logs" / "trainer.log")
        for step in range(10):
            log.info("step %d %s", step, "x" * 2000)
    finally:
        for handler in list(logging.getLogger().handlers):
            if getattr(handler, "_prime", False):
                logging.getLogger().removeHandler(handler)
                handler.close()
    captured = capsys.readouterr()
    assert captured.err == f"{FULL} writing the log to {out}/logs/trainer.log; later log lines go to the console only\n"
    assert [line.split()[3:5] for line in captured.out.splitlines()] == [["step", str(s)] for s in range(10)]


@pytest.fixture
def model_and_optimizer(one_rank_group):
    from prime_models import load_model

    model = load_model(TINY_QWEN3, seed=0)
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize("save_async", [False, True])
def test_a_checkpoint_on_a_full_disk_names_its_step_and_the_last_complete_one_stays(
    disk, model_and_optimizer, save_async
):
    model, optimizer = model_and_optimizer
    out = disk(700)
    manager = CheckpointManager(CheckpointConfig(interval=1, save_async=save_async), RunDir(out), WORLD)
    manager.save(1, model, optimizer, {})
    manager.wait()
    fill(out, leave=64 << 10)
    with pytest.raises(StorageError) as e:
        manager.save(2, model, optimizer, {})
        manager.wait()
    assert str(e.value) == f"{FULL} writing checkpoint step 2 to {RunDir(out).trainer_checkpoint(2)}"
    assert manager.saved_steps() == [1] and RunDir(out).checkpoint_steps() == [1]
    (out / "filler").unlink()
    manager._pending = None
    manager.load(1, model, optimizer)  # the complete one still loads


def test_weights_on_a_full_disk_name_their_step_and_leave_no_partial_directory(disk, model_and_optimizer):
    model, _ = model_and_optimizer
    out = disk(400)
    publisher = FilesystemPublisher(RunDir(out), WORLD, async_level=1, tokenizer=str(out / "none"))
    publisher.publish(1, model)
    fill(out, leave=64 << 10)
    with pytest.raises(StorageError) as e:
        publisher.publish(2, model)
    assert str(e.value) == f"{FULL} writing weights step 2 to {RunDir(out).weight_step(2)}"
    assert RunDir(out).stable_weight_steps() == [1] and not RunDir(out).weight_step(2).exists()
    assert leftovers(out) == []


def test_storage_error_line_without_what_names_the_file():
    e = OSError(28, os.strerror(28), "/x/y")
    assert storage_error_line(e) == f"{FULL} writing /x/y"


def test_an_orchestrator_checkpoint_on_a_full_disk_names_its_step(disk):
    from prime_orchestrator.orchestrator import Orchestrator

    from tests.orchestrator.test_curriculum import NUM_EXAMPLES, config

    out = disk(64)
    orch = Orchestrator(config(out, sampler="difficulty_pool"))
    orch.curriculum.start(NUM_EXAMPLES)
    fill(out, leave=0)
    with pytest.raises(StorageError) as e:
        orch._save_checkpoint(2)
    path = RunDir(out).orchestrator_checkpoint(2)
    assert str(e.value) == f"{FULL} writing orchestrator checkpoint step 2 to {path}"
    assert not path.exists() and leftovers(out) == []
