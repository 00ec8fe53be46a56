"""Context parallelism over gloo on CPU: packed rows split over CP=2 ranks (ring attention) equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models.parallel.context_parallel import ContextParallel, zigzag_index

from tests.models.conftest import VOCAB, tiny_config

ROWS, SEQ = 2, 32
TOL = 1e-5


def _data():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    # Several samples per row; boundaries fall inside and across the 2 * cp zig-zag chunks (8 tokens each at cp=2).
    lengths = [[5, 9, 3, 11, 4], [14, 2, 16]]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    weights = torch.randn(ROWS, SEQ, generator=g)
    return ids, pos, torch.roll(ids, -1, dims=1), weights


def _model(model_type: str):
    # 4 query heads over 2 kv heads: the ring carries grouped K/V and expands them per block.
    return load_model(tiny_config(model_type, num_hidden_layers=2), seed=0)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().clone()
    return out


def _reference(model_type: str):
    model = _model(model_type)
    ids, pos, targets, weights = _data()
    lp, ent = model(ids, pos, targets=targets)
    loss = (lp * weights).sum() + 0.1 * ent.sum()
    loss.backward()
    return {"loss": loss.item(), "logprobs": lp.detach(), "grads": _grads(model)}


def _cp_run(model_type: str, world: int, cp: int, ep: int, ac: str) -> dict:
    model = _model(model_type)
    dims = ParallelDims(cp=cp, ep=ep, world_size=world)
    mesh = dims.build_mesh("cpu")
    get_model_spec(model_type).parallelize_fn(model, dims, mesh=mesh, ac=ac)
    ids, pos, targets, weights = _data()
    shard = ContextParallel(mesh.cp).shard(pos)
    with shard:
        lp_local, ent_local = model(shard.split(ids), shard.split(pos), targets=shard.split(targets))
    lp, ent = shard.gather(lp_local), shard.gather(ent_local)
    # Every CP rank computes the same full-row loss: FSDP's average over the cp ranks undoes the replication.
    loss = (lp * weights).sum() + 0.1 * ent.sum()
    loss.backward()
    return {"loss": loss.item(), "logprobs": lp.detach(), "grads": _grads(model)}


def _worker(rank: int, world: int, scenarios: list, init: str, out: str):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        results = {name: _cp_run(model_type, world, cp, ep, ac) for name, model_type, cp, ep, ac in scenarios}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


SCENARIOS = [
    ("qwen3_cp2", "qwen3", 2, 1, "none"),
    ("qwen3_cp2_full_ac", "qwen3", 2, 1, "full"),
    ("qwen3_moe_cp2_ep2", "qwen3_moe", 2, 2, "none"),
]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    mp.spawn(_worker, args=(2, SCENARIOS, str(tmp / "init"), str(tmp / "out")), nprocs=2, join=True)
    return [torch.load(tmp / f"out.{rank}") for rank in range(2)]


@pytest.mark.integration
@pytest.mark.parametrize(("name", "model_type"), [(s[0], s[1]) for s in SCENARIOS])
def test_cp2_equals_single_process(cp_results, name, model_type):
    ref = _reference(model_type)
    for rank, results in enumerate(cp_results):
        got = results[name]
        assert got["loss"] == pytest.approx(ref["loss"], abs=TOL * abs(ref["loss"]))
        assert (got["logprobs"] - ref["logprobs"]).abs().max().item() < TOL
        diffs = {k: (got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"]}
        worst = max(diffs, key=diffs.get)
        print(
            f"{name} rank {rank}: loss {got['loss']:.6f} vs {ref['loss']:.6f}, max grad diff {diffs[worst]:.2e} ({worst})"
        )
        assert diffs[worst] < TOL, worst


def test_zigzag_layout_covers_the_row_once():
    parts = [zigzag_index(32, 4, r) for r in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(32))
    assert parts[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        zigzag_index(30, 2, 0)


def test_cp_validation():
    dims = ParallelDims(cp=2, world_size=4)
    assert (dims.dp_shard, dims.fsdp_size, dims.dp) == (2, 4, 2)
    with pytest.raises(ValueError, match="seq_len=30 must be divisible by 2 \\* cp = 4"):
        dims.validate_seq_len(30)
    with pytest.raises(ValueError, match="not divisible by dp_replicate\\(1\\) \\* cp\\(4\\)"):
        ParallelDims(cp=4, world_size=6)


# --- GPU: the CUDA ring kernel (memory-efficient attention with bias and log-sum-exp) --------------------------------


def _gpu_worker(rank: int, world: int, init: str, out: str):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world, device_id=device)
    try:
        ids, pos, targets, weights = (t.to(device) for t in _data())
        ref_model = _model("qwen3").to(device)
        lp_ref, _ = ref_model(ids, pos, targets=targets)
        (lp_ref * weights).sum().backward()
        model = _model("qwen3").to(device)
        # A one-GPU host still runs the ring code (a ring of one rank) with the CUDA kernels.
        shard = ContextParallel(dist.group.WORLD).shard(pos)
        with shard:
            lp_local, _ = model(shard.split(ids), shard.split(pos), targets=shard.split(targets))
        lp = shard.gather(lp_local)
        ((lp * weights).sum() / world).backward()
        errors = [(lp - lp_ref).abs().max().item()]
        for p, p_ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            dist.all_reduce(p.grad)
            errors.append((p.grad - p_ref.grad).abs().max().item())
        torch.save(errors, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_ring_attention_equals_single_device(tmp_path):
    world = min(torch.cuda.device_count(), 2)
    mp.spawn(_gpu_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "g")), nprocs=world, join=True)
    for rank in range(world):
        errors = torch.load(tmp_path / f"g.{rank}")
        print(f"rank {rank}: max |log-prob diff| {errors[0]:.2e}, max |grad diff| {max(errors[1:]):.2e}")
        # fp32 on both sides; TF32 matmuls may be on, hence not 1e-6.
        assert max(errors) < 1e-3
