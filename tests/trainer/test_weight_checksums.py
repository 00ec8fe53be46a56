"""Published weights are checksummed: the trainer records the CRC-32 of every file of ``weights/step_N``
(``checksums.json``), and every reader of the files refuses one whose bytes changed after it was written.

benchmarks/chaos.py wrote random bytes over part of a published ``model.safetensors``: finite values, so the load's
finiteness check passed them; requests then answered NaN logits, a corrupt final model let ``rl`` exit 0, and
``--resume`` served the same corrupt step again. The old writer recorded nothing, so each test below failed on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prime_core.run_dir import RunDir
from prime_core.schemas.weights import CHECKSUMS_FILE, ChangedWeights, file_crc32, verify_weights
from prime_trainer.weights.filesystem import FilesystemPublisher
from prime_trainer.world import World

from tests.tiny import build_chatml_tokenizer, free_port
from tests.trainer.trainer_utils import TINY_QWEN3

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def published(tmp_path_factory, one_rank_group) -> RunDir:
    """A run directory with weights steps 1 and 2 published by the trainer's filesystem transport."""
    from prime_models import load_model

    run_dir = RunDir(tmp_path_factory.mktemp("run"))
    publisher = FilesystemPublisher(run_dir, WORLD, async_level=1, tokenizer=str(run_dir.root / "none"))
    model = load_model(TINY_QWEN3, seed=0)
    for step in (1, 2):
        publisher.publish(step, model)
    return run_dir


@pytest.fixture
def run_dir(published, tmp_path) -> RunDir:
    shutil.copytree(published.root, tmp_path / "run")
    return RunDir(tmp_path / "run")


def scribble(weight_dir: Path) -> Path:
    """Random bytes over the middle of the step's safetensors file, as chaos.py did; returns the file."""
    file = weight_dir / "model.safetensors"
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(os.urandom(64))
    return file


def changed_line(file: Path, step: int) -> str:
    sums = json.loads((file.parent / CHECKSUMS_FILE).read_text())
    return (
        f"weights step {step}: {file}: its bytes changed after the trainer wrote it (CRC-32 {file_crc32(file)}, "
        f"written as {sums[file.name]})"
    )


def test_every_published_file_is_summed_and_the_sums_taken_in_memory_are_the_files(published):
    weight_dir = published.weight_step(2)
    sums = json.loads((weight_dir / CHECKSUMS_FILE).read_text())
    on_disk = {f.name for f in weight_dir.iterdir()} - {CHECKSUMS_FILE, "STABLE"}
    assert set(sums) == on_disk and "model.safetensors" in sums
    assert sums == {name: file_crc32(weight_dir / name) for name in sums}
    verify_weights(weight_dir, 2)


def test_the_inference_server_refuses_changed_weights_before_its_engine_loads_them(run_dir):
    from prime_core.schemas.weights import WeightUpdateRequest
    from prime_inference.protocol import RequestError
    from prime_inference.weights import update_weights

    loads = []
    engine = SimpleNamespace(update_weights=lambda path, step: loads.append(path))
    file = scribble(run_dir.weight_step(2))
    request = WeightUpdateRequest(weight_dir=str(file.parent), step=2)
    with pytest.raises(RequestError) as e:
        asyncio.run(update_weights(engine, request, [run_dir.root]))
    assert (str(e.value), e.value.status_code, loads) == (changed_line(file, 2), 400, [])


def test_resume_refuses_a_step_whose_weights_changed_and_names_the_rewind(run_dir):
    from prime_launch.resume import check_resume_weights

    file = scribble(run_dir.weight_step(2))
    with pytest.raises(ValueError) as e:
        check_resume_weights((1, 2), [run_dir], run_dir.root)
    assert str(e.value) == (
        f"--resume: checkpoint step 2 is not resumable: {changed_line(file, 2)}; `prime-launch rewind --output-dir "
        f"{run_dir.root} --step 1` drops it, then --resume starts at checkpoint 1"
    )
    check_resume_weights((1,), [run_dir], run_dir.root)  # the step before is intact


def test_eval_steps_refuses_changed_weights_before_anything_is_scored(run_dir):
    from prime_core.config.orchestrator import EvalConfig
    from prime_orchestrator.eval_runner import StepsNotReady, wait_for_steps

    file = scribble(run_dir.weight_step(2))
    config = EvalConfig.model_validate({"weights_dir": str(run_dir.weights), "steps": [1, 2]})
    with pytest.raises(StepsNotReady) as e:
        asyncio.run(wait_for_steps(config))
    assert str(e.value) == f"--steps: {changed_line(file, 2)}; nothing was scored"


def test_a_changed_final_model_fails_the_run(run_dir):
    from prime_launch.launcher import _check_final_weights

    errors: list[str] = []
    plan = SimpleNamespace(runs={}, run_dir=run_dir)
    console = SimpleNamespace(error=errors.append)
    assert (_check_final_weights(plan, console), errors) == (0, [])
    file = scribble(run_dir.weight_step(2))
    assert _check_final_weights(plan, console) == 1
    assert errors == [f"the final weights are broken: {changed_line(file, 2)}"]


def test_weights_of_a_writer_without_checksums_still_load(run_dir):
    from prime_core.schemas.weights import WeightUpdateRequest
    from prime_inference.weights import update_weights

    weight_dir = run_dir.weight_step(2)
    (weight_dir / CHECKSUMS_FILE).unlink()
    scribble(weight_dir)  # nothing to tell it by: the load's own checks are all there is
    verify_weights(weight_dir, 2)

    async def load(path, step):
        loads.append(path)

    loads: list[str] = []
    engine = SimpleNamespace(update_weights=load, info=SimpleNamespace(weight_step=2))
    request = WeightUpdateRequest(weight_dir=str(weight_dir), step=2)
    assert asyncio.run(update_weights(engine, request, [run_dir.root]))["weight_step"] == 2
    assert loads == [str(weight_dir)]


def test_a_missing_or_unreadable_sum_file_is_named(run_dir):
    weight_dir = run_dir.weight_step(1)
    (weight_dir / "model.safetensors").unlink()
    with pytest.raises(ChangedWeights, match=r"^weights step 1: .*/model.safetensors is gone or unreadable after"):
        verify_weights(weight_dir, 1)
    (weight_dir / CHECKSUMS_FILE).write_text("[1, 2]")
    with pytest.raises(ChangedWeights, match=r"checksums.json is unreadable \(not an object of file name -> CRC-32\)"):
        verify_weights(weight_dir, 1)


def test_a_server_started_on_changed_weights_refuses_to_start(run_dir):
    """One line and exit 2, naming the step before to serve and the rewind that trains the step again."""
    from prime_core.io import mark_stable

    for part in (run_dir.trainer_checkpoint(1), run_dir.orchestrator_checkpoint(1), run_dir.checkpoint_step(1)):
        part.mkdir(parents=True, exist_ok=True)
        mark_stable(part)
    file = scribble(run_dir.weight_step(2))
    build_chatml_tokenizer(["a tokenizer for the server's own checks"]).save_pretrained(str(file.parent))
    cmd = [str(Path(sys.executable).parent / "inference"), "--model.name", str(file.parent), "--engine", "torch",
           "--output-dir", str(run_dir.root / "serve"), "--server.port", str(free_port())]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    instead = (
        f"serve step 1 instead (--model.name {run_dir.weight_step(1)}), or `prime-launch rewind --output-dir "
        f"{run_dir.root} --step 1` drops it, then rl --resume trains it again from checkpoint 1"
    )
    line = f"error: model.name: {changed_line(file, 2)}; {instead}"
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, line)


def test_a_server_started_on_changed_weights_outside_a_run_says_only_what_changed(run_dir, tmp_path, capsys):
    """A copy outside a run, and step 1 of a run (nothing before it), have nothing else to offer."""
    from prime_inference.entrypoints.inference import check_model_files

    file = scribble(run_dir.weight_step(1))
    served = shutil.copytree(file.parent, tmp_path / "final")
    for weight_dir, what in ((served, "weights"), (file.parent, "weights step 1")):
        with pytest.raises(SystemExit) as e:
            check_model_files(SimpleNamespace(model=SimpleNamespace(name=str(weight_dir))))
        line = changed_line(weight_dir / file.name, 1).replace("weights step 1", what)
        assert (e.value.code, capsys.readouterr().err) == (2, f"error: model.name: {line}\n")


@pytest.mark.parametrize(
    ("flags", "field", "again"),
    [(["--resume"], "--resume", "--resume"), (["--ckpt.resume-step", "2"], "ckpt.resume_step", "--ckpt.resume-step 1")],
)
def test_rl_resume_refuses_a_checkpoint_whose_weights_changed_in_one_line(run_dir, flags, field, again):
    """``--resume`` and an explicit ``ckpt.resume_step`` (which skipped the check before) refuse alike."""
    from prime_core.io import mark_stable

    for step in (1, 2):
        for part in (run_dir.trainer_checkpoint(step), run_dir.orchestrator_checkpoint(step)):
            part.mkdir(parents=True)
            mark_stable(part)
        mark_stable(run_dir.checkpoint_step(step))
    file = scribble(run_dir.weight_step(2))
    root = Path(__file__).resolve().parents[2]
    cmd = [str(Path(sys.executable).parent / "rl"), "@", str(root / "examples/reverse_text/rl.toml"),
           "--output-dir", str(run_dir.root), *flags, "--dry-run"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        f"{field}: checkpoint step 2 is not resumable: {changed_line(file, 2)}; `prime-launch rewind --output-dir "
        f"{run_dir.root} --step 1` drops it, then {again} starts at checkpoint 1"
    ), result.stderr
    assert not (run_dir.configs / "trainer.toml").exists()  # refused before anything was written


def test_an_explicit_resume_step_is_checked_whatever_the_newest(run_dir):
    """``ckpt.resume_step`` 1 under a newer step 2: step 1's weights are the ones checked; none before it to offer."""
    from prime_launch.resume import check_resume_weights

    check_resume_weights((1, 2), [run_dir], run_dir.root, 1)
    file = scribble(run_dir.weight_step(1))
    with pytest.raises(ValueError) as e:
        check_resume_weights((1, 2), [run_dir], run_dir.root, 1)
    assert str(e.value) == (
        f"ckpt.resume_step: checkpoint step 1 is not resumable: {changed_line(file, 1)}; no earlier checkpoint to "
        "resume from (start afresh with --overwrite)"
    )
    check_resume_weights((1, 2), [run_dir], run_dir.root)  # --resume takes step 2, intact
    sums = run_dir.weight_step(2) / CHECKSUMS_FILE
    sums.write_text('{"model.safetensors": "0')  # cut short
    with pytest.raises(ValueError, match=r"^--resume: checkpoint step 2 is not resumable: weights step 2: .*checksums"):
        check_resume_weights((1, 2), [run_dir], run_dir.root)
    os.truncate(sums, 17 * 2**20)  # past the cap (16 MiB), as a sparse file: refused by its size, unread
    with pytest.raises(ValueError, match=r"^ckpt.resume_step: checkpoint step 2 is not resumable: weights step 2: "):
        check_resume_weights((1, 2), [run_dir], run_dir.root, 2)


def test_save_hf_sums_each_shard_from_memory_as_the_file_reads(tmp_path, one_rank_group):
    from prime_models import load_model, save_hf

    sums = save_hf(load_model(TINY_QWEN3, seed=0), tmp_path, max_shard_size="8KB", dtype=torch.bfloat16)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(sums) == shards
    assert sums == {name: file_crc32(tmp_path / name) for name in shards}
