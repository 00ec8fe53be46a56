"""Multi-tenant LoRA trainer: two runs share one trainer and base; each adapter trains on its own run's data only."""

import json

import pytest
import torch
from prime_core.io import is_stable
from prime_core.run_dir import RunDir
from prime_core.schemas.adapters import ADAPTER_INFO

from tests.trainer.test_lora_trainer import adapter, args, save_base
from tests.trainer.test_nonfinite import batches as nan_batches
from tests.trainer.trainer_utils import read_trainer_metrics, run_cli, write_rollouts


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("lora-base"))


@pytest.mark.integration
def test_multi_tenant_runs_train_only_on_their_own_data(base_dir, tmp_path):
    run_a, run_b, trainer = tmp_path / "run_a", tmp_path / "run_b", tmp_path / "trainer"
    write_rollouts(run_a, steps=3, num_ranks=1)
    write_rollouts(run_b, steps=3, num_ranks=1, seq_len=24)  # different data (and shapes) for B
    runs = json.dumps([{"name": "a", "output_dir": str(run_a)}, {"name": "b", "output_dir": str(run_b), "lr": 5e-3}])
    run_cli(args(base_dir, trainer, 2, "--runs", runs, "--ckpt.interval", "2"))
    run_cli(args(base_dir, trainer, 3, "--runs", runs, "--ckpt.resume-step", "2"))

    # Run A alone, single-tenant, on the same rollouts: adapter A must come out identical.
    alone = tmp_path / "alone"
    write_rollouts(alone, steps=3, num_ranks=1)
    run_cli(args(base_dir, alone, 3, "--model.lora.name", "a"))

    for step in range(4):
        for run, name in ((run_a, "a"), (run_b, "b")):
            d = RunDir(run).weight_step(step)
            if step >= 2:
                assert is_stable(d), d
                assert json.loads((d / ADAPTER_INFO).read_text())["name"] == name
    wa, walone, wb = (adapter(RunDir(p).weight_step(3)) for p in (run_a, alone, run_b))
    assert max((wa[k] - walone[k]).abs().max().item() for k in wa) < 1e-6
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)
    ma, malone, mb = read_trainer_metrics(run_a), read_trainer_metrics(alone), read_trainer_metrics(run_b)
    assert [ma[s]["loss/mean"] for s in range(3)] == pytest.approx([malone[s]["loss/mean"] for s in range(3)])
    assert mb[0]["lr"] == 5e-3 and ma[0]["lr"] == 1e-2
    assert is_stable(RunDir(trainer).trainer_checkpoint(2))


@pytest.mark.integration
def test_an_adapter_with_nan_gradients_sits_the_step_out_and_the_other_run_trains(base_dir, tmp_path):
    run_a, run_b, trainer, alone = tmp_path / "run_a", tmp_path / "run_b", tmp_path / "trainer", tmp_path / "alone"
    for out in (run_a, alone):
        write_rollouts(out, steps=3, num_ranks=1)
    write_rollouts(run_b, steps=3, num_ranks=1, batches_of=lambda s: nan_batches(s, poisoned=s == 1))
    runs = json.dumps([{"name": "a", "output_dir": str(run_a)}, {"name": "b", "output_dir": str(run_b)}])
    run_cli(args(base_dir, trainer, 3, "--runs", runs))
    run_cli(args(base_dir, alone, 3, "--model.lora.name", "a"))

    ma, mb = read_trainer_metrics(run_a), read_trainer_metrics(run_b)
    assert [mb[s]["optim/skipped"] for s in range(3)] == [0, 1, 0]
    assert [ma[s]["optim/skipped"] for s in range(3)] == [0, 0, 0]
    wa, walone, wb = (adapter(RunDir(p).weight_step(3)) for p in (run_a, alone, run_b))
    assert max((wa[k] - walone[k]).abs().max().item() for k in wa) < 1e-6
    assert all(torch.isfinite(v).all() for v in wb.values())
    # What B published after its skipped step 1 (weights 2) is what it published after step 0 (weights 1).
    before, skipped = (adapter(RunDir(run_b).weight_step(s)) for s in (1, 2))
    assert all(torch.equal(before[k], skipped[k]) for k in before)


def test_multi_tenant_config_errors():
    from prime_core.config.trainer import TrainerConfig
    from pydantic import ValidationError

    runs = [{"name": "a", "output_dir": "/tmp/a"}, {"name": "a", "output_dir": "/tmp/b"}]
    with pytest.raises(ValidationError, match="needs model.lora"):
        TrainerConfig.model_validate({"runs": runs[:1]})
    with pytest.raises(ValidationError, match="unique"):
        TrainerConfig.model_validate({"runs": runs, "model": {"lora": {}}})
    with pytest.raises(ValidationError, match="own output_dir"):
        TrainerConfig.model_validate({"runs": [runs[0], {**runs[0], "name": "b"}], "model": {"lora": {}}})
    with pytest.raises(ValidationError, match="filesystem"):
        TrainerConfig.model_validate({"runs": runs[:1], "model": {"lora": {}}, "transport": {"type": "zmq"}})
    with pytest.raises(ValidationError, match="weights.broadcast.type"):
        TrainerConfig.model_validate({"model": {"lora": {}}, "weights": {"broadcast": {"type": "nccl"}}})
