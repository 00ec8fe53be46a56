"""Expert parallelism over gloo on CPU: EP=2 (and EP=2 inside 4 FSDP ranks) trains exactly like one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prime_models import ParallelDims, get_model_spec, hf_state_dict, load_model
from prime_models.layers.moe import LocalDispatcher

from tests.models.conftest import VOCAB, tiny_config
from tests.ranks import leave_group

# Runs training processes: on the same xdist worker as the others (they oversubscribe 2 cores together).
pytestmark = pytest.mark.xdist_group("multiprocess")

BATCH, SEQ, LR = 4, 16, 1e-2
TOL = 1e-5


def _data():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    # Packed rows: two samples per row, positions restarting at 0.
    pos = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).expand(BATCH, SEQ)
    return ids[:, :-1], ids[:, 1:], pos


def _model(num_experts: int = 8):
    # Three MoE layers; norm_topk_prob off so the router weights' gradients are exercised through the combine.
    cfg = tiny_config("qwen3_moe", num_experts=num_experts, num_hidden_layers=3, norm_topk_prob=False)
    return load_model(cfg, seed=0)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf_state_dict(model)}


def _step(model, rank: int, world: int, scale: float):
    """Loss over this rank's rows normalized by the global token count (summing over ranks gives the mean)."""
    ids, targets, pos = _data()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    lp, _ = model(ids[rows], pos[rows], targets=targets[rows])
    loss = -lp.sum() / (BATCH * SEQ)
    (loss * scale).backward()
    return loss.detach()


def _reference() -> tuple[float, dict, dict]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = _step(model, 0, 1, 1.0)
    grads = _grads(model)
    opt.step()
    return float(loss), grads, _weights(model)


def _ep_run(rank: int, world: int, ep: int, ac: str) -> dict:
    torch.manual_seed(0)
    model = _model()
    get_model_spec("qwen3_moe").parallelize_fn(model, ParallelDims(ep=ep, world_size=world), ac=ac)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # FSDP averages dense gradients over the world; the loss already carries the global normalization.
    loss = _step(model, rank, world, float(world))
    dist.all_reduce(loss)
    grads = _grads(model)
    opt.step()
    return {"loss": float(loss), "grads": grads, "weights": _weights(model)}


def _dispatch_run(rank: int, world: int) -> list[float]:
    """AllToAllDispatcher against LocalDispatcher on skewed routing (some ranks and experts receive nothing)."""
    from prime_models.parallel.expert_parallel import AllToAllDispatcher, apply_expert_parallel

    model = _model(num_experts=6)
    moe = model.moe_layers()[0]
    xs = [torch.randn(10 + 3 * r, 32, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    xs = [x.requires_grad_() for x in xs]
    top_ws = [torch.rand(x.shape[0], 2, generator=torch.Generator().manual_seed(r)) for r, x in enumerate(xs)]
    top_ws = [w.requires_grad_() for w in top_ws]
    # Every token picks expert 0 and one of experts 1-2: with 2 ranks of 3 experts, rank 1 receives no token.
    top_idxs = [torch.stack([torch.zeros(len(x), dtype=torch.long), 1 + torch.arange(len(x)) % 2], 1) for x in xs]
    ref = sum(
        LocalDispatcher()(x, w, i, moe.experts).square().sum() for x, w, i in zip(xs, top_ws, top_idxs, strict=True)
    )
    weights = [moe.experts.gate_up_proj, moe.experts.down_proj]
    ref_grads = torch.autograd.grad(ref, [xs[rank], top_ws[rank], *weights])
    ref_grads = [*ref_grads[:2], *(g.chunk(world)[rank] for g in ref_grads[2:])]
    ref_y = LocalDispatcher()(xs[rank], top_ws[rank], top_idxs[rank], moe.experts)

    apply_expert_parallel(model, ParallelDims(ep=world, world_size=world).build_mesh("cpu").ep)
    assert isinstance(moe.dispatcher, AllToAllDispatcher)
    assert torch.equal(moe.experts.down_proj.to_local(), weights[1].detach().chunk(world)[rank])
    y = moe.dispatcher(xs[rank], top_ws[rank], top_idxs[rank], moe.experts)
    grads = torch.autograd.grad(
        y.square().sum(), [xs[rank], top_ws[rank], moe.experts.gate_up_proj, moe.experts.down_proj]
    )
    grads = [*grads[:2], *(g.to_local() for g in grads[2:])]
    return [(y - ref_y).abs().max().item()] + [
        (a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)
    ]


def _worker(rank: int, world: int, scenarios: list, init: str, out: str):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        results = {}
        for name, ep, ac in scenarios:
            results[name] = _dispatch_run(rank, world) if name == "dispatch" else _ep_run(rank, world, ep, ac)
        if rank == 0:
            torch.save(results, out)
    finally:
        leave_group()


def _spawn(world: int, scenarios: list, tmp_path) -> dict:
    out = tmp_path / f"ep_ws{world}.pt"
    mp.spawn(_worker, args=(world, scenarios, str(tmp_path / "init"), str(out)), nprocs=world, join=True)
    return torch.load(out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    scenarios = [("ep2", 2, "none"), ("ep2_full_ac", 2, "full"), ("dispatch", 2, "none")]
    return _spawn(2, scenarios, tmp_path_factory.mktemp("ep2"))


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _check(got: dict, reference, label: str) -> None:
    ref_loss, ref_grads, ref_weights = reference
    assert got["loss"] == pytest.approx(ref_loss, abs=TOL)
    assert got["grads"].keys() == ref_grads.keys()
    grad_diff = {k: (got["grads"][k] - ref_grads[k]).abs().max().item() for k in ref_grads}
    worst = max(grad_diff, key=grad_diff.get)
    print(f"{label}: loss {got['loss']:.7f} vs {ref_loss:.7f}; max grad diff {grad_diff[worst]:.2e} ({worst})")
    assert grad_diff[worst] < TOL, worst
    assert all(ref_grads[k].abs().max() > 0 for k in ref_grads if ".experts." in k)
    # HF export gathers the expert shards: the full per-expert tensors after one AdamW step match.
    assert got["weights"].keys() == ref_weights.keys()
    assert max((got["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights) < TOL


@pytest.mark.integration
@pytest.mark.parametrize("name", ["ep2", "ep2_full_ac"])
def test_ep2_equals_single_process(two_ranks, reference, name):
    _check(two_ranks[name], reference, name)


@pytest.mark.integration
def test_all_to_all_dispatcher_equals_local(two_ranks):
    assert max(two_ranks["dispatch"]) < 1e-6


@pytest.mark.integration
@pytest.mark.slow
def test_ep2_inside_four_fsdp_ranks(reference, tmp_path):
    # dp_shard=4, ep=2: each expert shard is also FSDP-sharded over 2 ranks.
    _check(_spawn(4, [("ep2", 2, "none")], tmp_path)["ep2"], reference, "world 4, ep2")


def test_ep_validation():
    with pytest.raises(ValueError, match="multiple of cp"):
        ParallelDims(ep=2, cp=4, world_size=4)
    with pytest.raises(ValueError, match="must divide dp_shard"):
        ParallelDims(ep=4, world_size=6)
    dims = ParallelDims(ep=4, cp=2, world_size=8)
    assert (dims.dp_shard, dims.fsdp_size, dims.expert_fsdp_size) == (4, 8, 2)
    with pytest.raises(ValueError, match="must divide the number of experts"):
        dims.validate_experts(6)
    with pytest.raises(ValueError, match="dense model has no experts"):
        dims.validate_experts(0)
    dims.validate_experts(8)


def test_dispatcher_kind_is_checked():
    from prime_models.parallel.expert_parallel import make_dispatcher

    with pytest.raises(ValueError, match="unknown expert dispatcher 'nccl'"):
        make_dispatcher("nccl", None, 8)


# --- GPU: DeepEP ----------------------------------------------------------------------------------------------------


def _deepep_worker(rank: int, world: int, init: str, out: str):
    from prime_models.parallel.expert_parallel import apply_expert_parallel

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world, device_id=device)
    try:
        # DeepEP wants real hidden sizes (its kernels move 16-byte aligned rows); 16 experts, top-4.
        cfg = tiny_config(
            "qwen3_moe", hidden_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4
        )
        moes = []
        for kind in ("torch", "deepep"):
            model = load_model(cfg, seed=0, device=device, dtype=torch.bfloat16)
            mesh = ParallelDims(ep=world, world_size=world).build_mesh("cuda")
            apply_expert_parallel(model, mesh.ep, dispatcher=kind)
            moes.append(model.moe_layers()[0])
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(4096 + 512 * rank, 1024, generator=g, device=device, dtype=torch.bfloat16)
        grad = torch.randn(x.shape, generator=g, device=device, dtype=torch.bfloat16)
        results = []
        for moe in moes:
            xi = x.clone().requires_grad_()
            y = moe(xi)
            y.backward(grad)
            results.append([y, xi.grad, moe.gate.weight.grad, moe.experts.gate_up_proj.grad.to_local()])
        errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(*results, strict=True)]
        torch.save(errors, f"{out}.{rank}")
    finally:
        leave_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_deepep_dispatcher_equals_torch_all_to_all(tmp_path):
    import importlib.util

    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("DeepEP is not installed (built from source, see docs/scaling.md)")
    world = min(torch.cuda.device_count(), 4)
    mp.spawn(_deepep_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "e")), nprocs=world, join=True)
    for rank in range(world):
        errors = torch.load(tmp_path / f"e.{rank}")
        print(f"rank {rank}: relative error deepep vs torch (out, grad x, grad router, grad experts) {errors}")
        # bf16 activations; the two paths sum expert outputs in different orders.
        assert max(errors) < 2e-2
