"""Trainer with expert and context parallelism on CPU (gloo): `--model.ep 2 --model.cp 2` over 2 processes trains
and exports the same weights as one process; impossible layouts fail with the config fields at fault."""

import json

import pytest
import torch
from prime_core.config import load_config
from prime_core.config.trainer import ParallelConfig, TrainerConfig
from prime_core.io import is_stable
from prime_core.run_dir import RunDir
from prime_trainer.parallel import parallel_dims, validate_model
from prime_trainer.world import World

from tests.trainer.trainer_utils import TINY_QWEN3, load_weights, read_trainer_metrics, run_cli, write_rollouts

# Runs training processes: on the same xdist worker as the others (they oversubscribe 2 cores together).
pytestmark = pytest.mark.xdist_group("multiprocess")

TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
COMMON = ["--seq-len", "32", "--optim.lr", "1e-3", "--seed", "3", "--async-level", "1", "--log.level", "warning"]


def _world(size: int) -> World:
    return World(rank=0, world_size=size, local_rank=0, device=torch.device("cpu"))


def _layout_error(size: int, *args: str) -> str:
    cfg = load_config(TrainerConfig, list(args))
    with pytest.raises(ValueError) as e:
        parallel_dims(_world(size), cfg.parallel, cfg.model)
    return str(e.value)


def test_impossible_layouts_name_the_fields():
    assert "model.cp=3 must divide the world size (4 ranks)" in _layout_error(4, "--model.cp", "3")
    assert "model.ep=2 must be a multiple of model.cp=4" in _layout_error(4, "--model.cp", "4", "--model.ep", "2")
    assert "model.ep=4 must divide parallel.dp_shard * model.cp = 6" in _layout_error(6, "--model.ep", "4")
    assert "parallel.dp_shard=3 must divide world size / model.cp = 4" in _layout_error(
        8, "--model.cp", "2", "--parallel.dp-shard", "3"
    )
    with pytest.raises(ValueError, match="model.ep"):
        load_config(TrainerConfig, ["--model.ep", "0"])
    with pytest.raises(ValueError, match="model.ep-dispatcher|model.ep_dispatcher"):
        load_config(TrainerConfig, ["--model.ep-dispatcher", "nccl"])

    cfg = load_config(TrainerConfig, ["--model.ep", "4", "--model.cp", "2"])
    dims = parallel_dims(_world(16), cfg.parallel, cfg.model)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep, dims.expert_fsdp_size) == (1, 8, 2, 4, 4)
    hsdp = parallel_dims(_world(16), ParallelConfig(dp_shard=2), cfg.model)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (4, 2)
    with pytest.raises(ValueError, match=r"model.ep=4 must divide the number of experts \(6\)"):
        validate_model(dims, {"num_experts": 6}, 64)
    with pytest.raises(ValueError, match="model.ep=4 needs a mixture-of-experts model"):
        validate_model(dims, {"model_type": "qwen3"}, 64)
    with pytest.raises(ValueError, match=r"model.cp=2: seq_len=30 must be divisible by 2 \* cp = 4"):
        validate_model(dims, {"num_experts": 8}, 30)
    validate_model(dims, {"num_experts": 8}, 64)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    (path / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    return path


def _args(model_dir, out, steps, *extra):
    return ["--model.name", str(model_dir), "--output-dir", str(out), "--max-steps", str(steps), *COMMON, *extra]


@pytest.mark.integration
def test_ep2_cp2_trainer_equals_one_process_and_resumes_as_one(tiny_moe_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    write_rollouts(one, steps=3, num_ranks=1)
    write_rollouts(two, steps=3, num_ranks=2)
    run_cli(_args(tiny_moe_dir, one, 3))
    # One CP group of 2 ranks that is also the EP group: both pool the 2 rank files and split every row.
    run_cli(_args(tiny_moe_dir, two, 2, "--model.ep", "2", "--model.cp", "2", "--ckpt.interval", "2"), nproc=2)

    m1, m2 = read_trainer_metrics(one), read_trainer_metrics(two)
    assert sorted(m2) == [0, 1]
    for step in m2:
        assert m1[step]["loss_tokens"] == m2[step]["loss_tokens"] and m1[step]["tokens"] == m2[step]["tokens"]
        for key in ("loss/mean", "entropy/mean", "mismatch_kl/mean", "grad_norm"):
            assert m2[step][key] == pytest.approx(m1[step][key], abs=1e-5, rel=1e-5), (step, key)
    # The exported HF weights hold every expert (gathered from the EP shards), equal to the single process's.
    w1, w2 = load_weights(RunDir(one).weight_step(2)), load_weights(RunDir(two).weight_step(2))
    assert w1.keys() == w2.keys() and any(".experts.3.down_proj" in k for k in w1)
    max_diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    print(f"ep2+cp2 vs 1 process: max weight diff {max_diff:.2e}")
    assert max_diff < 1e-5
    assert is_stable(RunDir(two).trainer_checkpoint(2))

    # The DCP checkpoint (expert DTensors sharded over EP) resumes in another layout: one plain process.
    write_rollouts(two, steps=3, num_ranks=1)
    run_cli(_args(tiny_moe_dir, two, 3, "--ckpt.resume-step", "2"))
    w1, w2 = load_weights(RunDir(one).weight_step(3)), load_weights(RunDir(two).weight_step(3))
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
