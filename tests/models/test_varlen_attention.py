"""Packed rows under SDPA on CUDA attend through torch's varlen flash kernel (no mask, no work across samples).

On CPU the kernel does not run, so the routing is checked with a reference stand-in of the same signature (each
sample's causal attention on its own); the kernel itself is checked against the mask on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prime_models import ParallelDims, apply_activation_checkpointing, get_model_spec, kernels, load_model
from prime_models.layers import attention
from prime_models.layers.attention import row_packing, use_row_packing
from prime_models.parallel import cuda_graphs as G
from prime_models.parallel.activation_checkpoint import ATTENTION_OPS
from prime_models.parallel.cuda_graphs import cuda_graphs_of

from tests.models.conftest import VOCAB, gpu_attention_config, rows_of_short_samples, tiny_config
from tests.models.cuda_graph_standin import graphs_on_cpu  # noqa: F401 (fixture)

LENGTHS = [5, 9, 2, 7]  # one row of four samples, and a second row of one
SEQ = sum(LENGTHS)


class _ReferenceVarlen:
    """torch's `varlen_attn` signature, computed sample by sample with causal SDPA; records its calls."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        self.calls.append(dict(cu=cu_q.tolist(), max_q=max_q, window=window_size, heads=(q.shape[1], k.shape[1])))
        assert torch.equal(cu_q, cu_k) and max_q == max_k and window_size == (-1, 0)
        out = torch.empty_like(q)
        for start, end in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], strict=True):
            if end == start:  # an empty sample (CUDA graphs pad cu_seqlens with them)
                continue
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            ).transpose(0, 1)
        return out


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(n) for n in LENGTHS]), torch.arange(SEQ)])
    return ids, positions


@pytest.fixture
def reference_varlen(monkeypatch):
    """Packed rows on CPU routed to the varlen path, served by `_ReferenceVarlen`."""
    ref = _ReferenceVarlen()
    monkeypatch.setattr(attention, "varlen_applies", lambda device: device is not None)
    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: ref)
    return ref


def _logprobs(model, ids, positions, packing: bool) -> torch.Tensor:
    with use_row_packing(row_packing(positions[:, :-1]) if packing else None):
        lp, _ = model(ids[:, :-1], positions[:, :-1], targets=ids[:, 1:])
    return lp


def test_packed_rows_attend_through_the_varlen_kernel_like_the_mask(reference_varlen):
    model = load_model(tiny_config("qwen3"), dtype=torch.bfloat16, seed=0)
    ids, positions = _rows()
    with torch.no_grad():
        varlen = _logprobs(model, ids, positions, packing=True)
        assert len(reference_varlen.calls) == model.args.num_layers
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "varlen_applies", lambda device: False)
            masked = _logprobs(model, ids, positions, packing=True)
    call = reference_varlen.calls[0]
    # Both rows flattened: the first row's four samples (the last cut by the shift), then the second row whole.
    assert call["cu"] == [0, 5, 14, 16, 22, 44] and call["max_q"] == 22
    assert call["heads"] == (4, 2)  # grouped-query K/V go in unexpanded
    assert (varlen.float() - masked.float()).abs().max().item() < 2e-2


def test_a_packing_the_forward_reads_itself_takes_the_mask(reference_varlen):
    """Without the host's packing the forward would have to read cu_seqlens back, and a CUDA graph cannot: both take
    the mask, so a graphed forward and an eager one run the same kernels."""
    model = load_model(tiny_config("qwen3"), dtype=torch.bfloat16, seed=0)
    ids, positions = _rows()
    with torch.no_grad():
        _logprobs(model, ids, positions, packing=False)
    assert reference_varlen.calls == []


def test_activations_the_kernel_does_not_take_fall_back_to_the_mask(reference_varlen):
    model = load_model(tiny_config("qwen3"), seed=0)  # fp32
    ids, positions = _rows()
    with torch.no_grad():
        fallback = _logprobs(model, ids, positions, packing=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "varlen_applies", lambda device: False)
            masked = _logprobs(model, ids, positions, packing=True)
    assert reference_varlen.calls == []
    assert torch.equal(fallback, masked)


def test_kept_attention_covers_the_varlen_kernel():
    if kernels.torch_varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert torch.ops.torch_attn._varlen_attn.default in ATTENTION_OPS


# Micro-batches of two 16-token rows (sample lengths per row) and the varlen bucket each falls into:
# (samples padded to a power of two, longest sample rounded up to one, at most the row).
GRAPHED_BATCHES = (
    (((4, 4, 8), (6, 10)), (8, 16)),
    (((3, 5, 8), (2, 6, 8)), (8, 8)),
    (((4, 4, 8), (16,)), (4, 16)),
    (((7, 9), (5, 11)), (4, 16)),
)


def _graphed_model(graphs: bool):
    model = load_model(tiny_config("qwen3", num_hidden_layers=2), seed=0)
    get_model_spec("qwen3").parallelize_fn(
        model, ParallelDims(world_size=1), param_dtype=torch.bfloat16, cuda_graphs=graphs
    )
    return model


def _train_packed(model) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for seed, (rows, _) in enumerate(GRAPHED_BATCHES):
        ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed))
        pos = torch.stack(
            [torch.cat([torch.arange(n) for n in row] + [torch.zeros(1, dtype=torch.long)]) for row in rows]
        )
        with use_row_packing(row_packing(pos[:, :-1])):
            lp, _ = model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])
        loss = -lp.mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.usefixtures("graphs_on_cpu")
def test_cuda_graphs_replay_the_varlen_kernel_one_graph_a_bucket(reference_varlen):
    eager_losses, eager_grads = _train_packed(_graphed_model(graphs=False))
    eager_calls, reference_varlen.calls[:] = list(reference_varlen.calls), []
    model = _graphed_model(graphs=True)
    losses, grads = _train_packed(model)
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    for got, want in zip(grads, eager_grads, strict=True):
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)
    graphs = cuda_graphs_of(model)
    buckets = [bucket for _, bucket in GRAPHED_BATCHES]
    assert sorted(key[2] for key in graphs.graphs) == sorted(set(buckets))
    assert (graphs.captures, graphs.replays) == (3, 4)
    # Every replayed forward ran the kernel on cu_seqlens padded with empty samples, for the bucket's longest sample.
    replayed = [c for c in reference_varlen.calls if len(c["cu"]) - 1 in {b[0] for b in buckets}]
    assert {(len(c["cu"]) - 1, c["max_q"]) for c in replayed} == set(buckets)
    assert all(c["cu"][-1] == 32 for c in reference_varlen.calls)
    assert all(len(c["cu"]) < 8 for c in eager_calls)  # eager forwards: the samples as they are


@pytest.mark.usefixtures("graphs_on_cpu")
def test_past_the_bucket_limit_packed_rows_replay_the_mask(monkeypatch, reference_varlen):
    monkeypatch.setattr(G, "MAX_VARLEN_KEYS", 2)
    model = _graphed_model(graphs=True)
    _train_packed(model)
    keys = cuda_graphs_of(model).graphs
    assert sorted(str(key[2]) for key in keys) == ["(8, 16)", "(8, 8)", "None"]


# --- GPU: the kernel itself ------------------------------------------------------------------------------------------


def _gpu_step(model, ids, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lp, _ = model(ids[:, :-1], positions[:, :-1], targets=ids[:, 1:])
    (-lp.float().mean()).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach().float(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("ac", ["none", "keep_attention", "offload_attention"])
def test_gpu_varlen_kernel_trains_like_the_mask(monkeypatch, ac):
    """bf16 Qwen3-shaped layers (GQA 16/8 heads of 128), rows of many short samples: log-probs and gradients of the
    varlen kernel against SDPA with the block-diagonal mask, with and without checkpointing that keeps its outputs."""
    cfg = gpu_attention_config()
    device = torch.device("cuda")
    ids, positions = rows_of_short_samples()
    ids, positions = ids.to(device), positions  # positions stay on the host for row_packing, as the trainer's
    results = {}
    for name, on in (("varlen", True), ("mask", False)):
        monkeypatch.setattr(kernels, "SDPA_VARLEN", on)
        model = load_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
        if ac != "none":
            apply_activation_checkpointing(
                model.model.layers, "full", keep_attention=-1, offload_attention=ac == "offload_attention"
            )
        with use_row_packing(row_packing(positions[:, :-1], device)):
            results[name] = _gpu_step(model, ids, positions.to(device))
    (lp_v, g_v), (lp_m, g_m) = results["varlen"], results["mask"]
    assert (lp_v - lp_m).abs().max().item() < 0.05
    for n, grad in g_m.items():
        rel = (g_v[n] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert rel.item() < 0.02, (n, rel.item())
