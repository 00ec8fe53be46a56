"""Context parallelism over gloo on CPU: packed rows split over CP=2 ranks (ring attention) equal one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models.parallel.context_parallel import ContextParallel, zigzag_index

from tests.models.conftest import VOCAB, tiny_config
from tests.ranks import leave_group

# Runs training processes: on the same xdist worker as the others (they oversubscribe 2 cores together).
pytestmark = pytest.mark.xdist_group("multiprocess")

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
        results["ring"] = _ring_measurements(dist.group.WORLD)
        torch.save(results, f"{out}.{rank}")
    finally:
        leave_group()


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


# --- the ring alone: exact against dense attention, and memory linear in the row length -----------------------------

RING_HEADS, RING_KV_HEADS, RING_HEAD_DIM = 4, 2, 16


def _packed_positions(seq: int, seed: int, max_len: int) -> torch.Tensor:
    """One row of random sample lengths in [1, max_len], cut to `seq` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = min(int(torch.randint(1, max_len + 1, (1,), generator=g)), seq - total)
        lengths.append(n)
        total += n
    return torch.cat([torch.arange(n) for n in lengths])


def _dense_attention(q_RSND, k_RSGD, v_RSGD, pos_RS, scale):
    doc = (pos_RS == 0).cumsum(-1)
    seq = pos_RS.shape[1]
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    rep = q_RSND.shape[2] // k_RSGD.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q_RSND, k_RSGD, v_RSGD))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale).transpose(
        1, 2
    )


def _ring_inputs(pos_RS: torch.Tensor, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, seq = pos_RS.shape
    shapes = [(RING_HEADS,), (RING_KV_HEADS,), (RING_KV_HEADS,), (RING_HEADS,)]
    return [torch.randn(rows, seq, *h, RING_HEAD_DIM, generator=g) for h in shapes]  # q, k, v, dout


def _ring_errors(
    group, mask_tile: int | None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> list[float]:
    """Max |ring - dense| of the output and dQ/dK/dV; for a `dtype` below fp32, relative to the largest dense value
    (the dense reference always runs in fp32 on the same rounded inputs)."""
    # Two rows with different layouts (so blocks are planned per row), long samples across chunks and short ones.
    seq = 64
    pos = torch.stack([_packed_positions(seq, seed=1, max_len=40), _packed_positions(seq, seed=2, max_len=9)])
    pos = pos.to(device)
    q, k, v, dout = (t.to(device, dtype) for t in _ring_inputs(pos.cpu(), seed=3))
    scale = RING_HEAD_DIM**-0.5
    full = [t.float().clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_attention(*full, pos, scale)
    ref.backward(dout.float())
    kwargs = {} if mask_tile is None else {"mask_tile": mask_tile}
    shard = ContextParallel(group, **kwargs).shard(pos)
    local = [shard.split(t).clone().requires_grad_() for t in (q, k, v)]
    out = shard.attention(*local, scale)
    out.backward(shard.split(dout))
    pairs = [(out, shard.split(ref))] + [(t.grad, shard.split(f.grad)) for t, f in zip(local, full, strict=True)]
    # dK/dV of a rank's tokens are complete on that rank (their accumulators came back around the ring).
    if dtype == torch.float32:
        return [(a - b).abs().max().item() for a, b in pairs]
    return [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in pairs]


def _peak_bytes(prof) -> int:
    """Highest live CPU memory during a profiled region, replayed from the allocation/free events in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _ring_peak(group, seq: int) -> int:
    """Peak memory of building the shard plus one attention forward and backward at row length `seq`."""
    from torch.profiler import ProfilerActivity, profile

    pos = _packed_positions(seq, seed=seq, max_len=seq // 3)[None]
    q, k, v, dout = _ring_inputs(pos, seed=4)
    local_q, local_k, local_v, local_dout = (
        t.index_select(1, zigzag_index(seq, dist.get_world_size(group), dist.get_rank(group))) for t in (q, k, v, dout)
    )
    local = [t.clone().requires_grad_() for t in (local_q, local_k, local_v)]
    del q, k, v, dout
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        shard = ContextParallel(group).shard(pos)
        out = shard.attention(*local, RING_HEAD_DIM**-0.5)
        out.backward(local_dout)
        del shard, out
    return _peak_bytes(prof)


def _ring_measurements(group) -> dict:
    # One thread: the profiled allocations then come from this thread only.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        errors = {tile: _ring_errors(group, tile) for tile in (None, 5)}
        return {"errors": errors, "peak": {seq: _ring_peak(group, seq) for seq in (4096, 8192)}}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.integration
def test_ring_attention_equals_dense_attention(cp_results):
    for rank, results in enumerate(r["ring"] for r in cp_results):
        for tile, errors in results["errors"].items():
            print(f"rank {rank} mask_tile={tile}: max |out diff| {errors[0]:.2e}, max |dq, dk, dv diff| {errors[1:]}")
            assert max(errors) < TOL


@pytest.mark.integration
def test_ring_attention_memory_is_linear_in_the_row(cp_results):
    """No (S/cp)^2 mask or bias: at S=4096, cp=2 the peak stays under 4 fp32 blocks of one zig-zag chunk pair."""
    for rank, results in enumerate(r["ring"] for r in cp_results):
        peak = results["peak"]
        block = (4096 // 4) ** 2 * 4  # one fp32 chunk x chunk block at S=4096, cp=2
        print(f"rank {rank}: peak {peak[4096] / 2**20:.1f} MiB at S=4096, {peak[8192] / 2**20:.1f} MiB at S=8192")
        assert peak[4096] < 4 * block
        # Doubling the row doubles the memory (q/k/v-sized buffers), where S^2 masks would quadruple it.
        assert peak[8192] < 2.5 * peak[4096]


# --- GPU: the CUDA ring kernels (FlashAttention-2, and memory-efficient attention with bias) ------------------------


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
        # The ring alone, also with tiny mask tiles so that causal, rectangle and masked kernel calls all run.
        for tile in (None, 5):
            errors += _ring_errors(dist.group.WORLD, tile, device)
        # bf16 takes FlashAttention for the mask-free calls (the masked ones stay on the memory-efficient kernel).
        bf16_errors = [e for tile in (None, 5) for e in _ring_errors(dist.group.WORLD, tile, device, torch.bfloat16)]
        torch.save((errors, bf16_errors), f"{out}.{rank}")
    finally:
        leave_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_ring_attention_equals_single_device(tmp_path):
    world = min(torch.cuda.device_count(), 2)
    mp.spawn(_gpu_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "g")), nprocs=world, join=True)
    for rank in range(world):
        errors, bf16_errors = torch.load(tmp_path / f"g.{rank}")
        print(f"rank {rank}: max |log-prob diff| {errors[0]:.2e}, max |grad diff| {max(errors[1:]):.2e}; bf16 ring vs "
              f"fp32 dense, relative: {max(bf16_errors):.2e}")  # fmt: skip
        # fp32 on both sides; TF32 matmuls may be on, hence not 1e-6.
        assert max(errors) < 1e-3
        assert max(bf16_errors) < 2e-2
