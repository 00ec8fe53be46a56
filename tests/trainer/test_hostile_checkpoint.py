"""A checkpoint someone else wrote (shared, downloaded, planted on a shared filesystem) and ``--resume`` from it: the
pickles in it (DCP's index, the optimizer's scalars, the RNG state) must not run code on the host. Each planted
payload below would create a marker file when unpickled the permissive way; the load refuses it in one line naming
the file, and the marker is never made. Checkpoints saved before the RNG state was stored as tensors still resume."""

import json
import pickle
import random

import numpy as np
import pytest
import torch
from prime_core.config.shared import CheckpointConfig
from prime_core.io import UnreadableFile
from prime_core.run_dir import RunDir
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.ckpt_safe import RNG_MAX_BYTES
from prime_trainer.world import World


class Payload:
    """What a hostile author pickles: unpickling it calls ``open(marker, "w")``, which creates the marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _manager(root):
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return CheckpointManager(CheckpointConfig(interval=1), RunDir(root), world)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def victim(tmp_path, one_rank_group):
    """A checkpoint at step 1 that the attacker edits, and the victim's model to resume into."""
    manager = _manager(tmp_path / "run")
    model, optimizer = _model()
    manager.save(1, model, optimizer, {"data_step": 1})
    ckpt = manager.run_dir.trainer_checkpoint(1)
    (ckpt / "checksums.json").unlink()  # the author leaves none (as checkpoints before them), or writes matching ones
    return manager, ckpt, tmp_path / "marker"


def _refused(manager, ckpt, marker, name):
    model, optimizer = _model()
    with pytest.raises(UnreadableFile) as e:
        manager.load(1, model, optimizer)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"checkpoint step 1 does not load: {ckpt}/{name}: "), line
    assert not marker.exists()  # nothing in the file ran
    return line


def test_a_pickled_payload_in_the_rng_state_is_refused_not_run(victim):
    manager, ckpt, marker = victim
    torch.save({"torch": torch.get_rng_state(), "python": Payload(marker), "numpy": None}, ckpt / "rng/rank_0.pt")
    line = _refused(manager, ckpt, marker, "rng/rank_0.pt")
    assert "UnpicklingError" in line, line


def test_a_pickled_payload_in_the_checkpoint_index_is_refused_not_run(victim):
    manager, ckpt, marker = victim
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    metadata.planner_data = Payload(marker)  # rides along inside the real index
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    line = _refused(manager, ckpt, marker, ".metadata")
    assert "refers to io.open, which a checkpoint index never holds" in line, line


def test_a_pickled_payload_in_the_optimizer_state_is_refused_not_run(tmp_path, one_rank_group):
    marker = tmp_path / "marker"
    author = _manager(tmp_path / "run")
    model, optimizer = _model()
    optimizer.param_groups[0]["lr"] = Payload(marker)  # DCP stores it as a byte item in the shard, pickled
    author.save(1, model, optimizer, {"data_step": 1})
    assert not marker.exists()
    _refused(_manager(tmp_path / "run"), author.run_dir.trainer_checkpoint(1), marker, "*.distcp")


def test_an_rng_state_file_too_large_to_be_one_is_refused_before_it_is_read(victim):
    manager, ckpt, marker = victim
    with open(ckpt / "rng/rank_0.pt", "r+b") as f:
        f.truncate(RNG_MAX_BYTES + 1)
    line = _refused(manager, ckpt, marker, "rng/rank_0.pt")
    assert f"{RNG_MAX_BYTES + 1} bytes, an RNG state is under {RNG_MAX_BYTES}" in line, line


def test_a_checkpoint_with_the_old_pickled_rng_state_still_resumes_it(victim):
    manager, ckpt, _ = victim
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    torch.save(old, ckpt / "rng/rank_0.pt")  # as the trainer wrote it before: NumPy's keys as an ndarray
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model, optimizer = _model()
    assert manager.load(1, model, optimizer)["data_step"] == 1
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_the_rng_state_round_trips_through_a_checkpoint(victim):
    manager, _, _ = victim
    model, optimizer = _model()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    manager.save(2, model, optimizer, {"data_step": 2})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    manager.load(2, model, optimizer)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_checkpoint_step_planted_as_a_link_is_saved_inside_the_run_and_the_target_untouched(tmp_path, one_rank_group):
    victim = tmp_path / "elsewhere"  # looks like a complete checkpoint: cleanup takes it for an old step
    (victim / "trainer").mkdir(parents=True)
    (victim / "STABLE").write_text("theirs\n")
    (victim / "trainer" / "STABLE").write_text("theirs\n")
    manager = _manager(tmp_path / "run")
    manager.config = CheckpointConfig(interval=1, keep=1)
    model, optimizer = _model()
    manager.run_dir.checkpoints.mkdir(parents=True)
    manager.run_dir.checkpoint_step(1).symlink_to(victim)
    manager.save(1, model, optimizer, {"data_step": 1})
    assert not manager.run_dir.checkpoint_step(1).is_symlink() and manager.saved_steps() == [1]
    manager.run_dir.checkpoint_step(1).rename(tmp_path / "step_1_saved")
    manager.run_dir.checkpoint_step(1).symlink_to(victim)  # planted again, now as an old step to delete
    manager.save(2, model, optimizer, {"data_step": 2})
    assert manager.saved_steps() == [2] and not manager.run_dir.checkpoint_step(1).exists()
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == ["STABLE", "trainer", "trainer/STABLE"]


def test_a_checkpoint_whose_progress_records_another_step_is_refused(victim):
    """A step directory copied or renamed over another: the trainer would resume at the step its progress.json says,
    the orchestrator at the directory's."""
    manager, ckpt, marker = victim
    progress = json.loads((ckpt / "progress.json").read_text())
    (ckpt / "progress.json").write_text(json.dumps({**progress, "step": 7}))
    line = _refused(manager, ckpt, marker, "progress.json")
    assert line.endswith(
        "progress.json: ValueError: records step 7, not the step of its directory (no earlier checkpoint)"
    )
