"""Resuming a checkpoint into a model that is not the one that saved it: a deeper model's checkpoint into a shallower
one (``num_hidden_layers`` lowered, or ``model.name`` pointing at a shallower sibling of the same width) loaded the
layers both have and dropped the rest without a word; it is one line naming a weight the model has not."""

import pytest
import torch
from prime_core.config import ConfigError
from prime_core.config.shared import CheckpointConfig
from prime_core.run_dir import RunDir
from prime_trainer.ckpt import CheckpointManager
from prime_trainer.world import World


def _manager(root):
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return CheckpointManager(CheckpointConfig(interval=1), RunDir(root), world)


def _model(num_layers: int, frozen: int = 0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(num_layers)])
    for layer in list(model)[:frozen]:
        layer.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_deeper_models_checkpoint_is_one_line_naming_a_weight_the_model_has_not(tmp_path, one_rank_group):
    manager = _manager(tmp_path)
    manager.save(1, *_model(4), {})
    with pytest.raises(ConfigError) as e:
        manager.load(1, *_model(2))
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"checkpoint step 1 in {tmp_path} holds 2.bias, which this model has not (4 such"), line


def test_weights_frozen_since_the_checkpoint_still_resume(tmp_path, one_rank_group):
    """A part trained then and frozen now (a vision tower) is in the model: the checkpoint resumes."""
    manager = _manager(tmp_path)
    saved, saved_optimizer = _model(3)
    manager.save(1, saved, saved_optimizer, {})
    model, optimizer = _model(3, frozen=1)
    assert manager.load(1, model, optimizer)["step"] == 1
    assert torch.equal(model[2].weight, saved[2].weight)
