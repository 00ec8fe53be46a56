"""``parallel.cuda_graphs``: the decoder stack of training forwards replayed from CUDA graphs
(`prime_models.parallel.cuda_graphs`) trains like the eager one on the one-rank bf16 path: losses, the fp32 masters'
gradients over micro-batches of different packings with an optimizer step between them (so the refreshed working
copy is what the graphs read), one capture per (shape, packed) key and a replay for every training forward.

On CPU the dispatch runs through a stand-in for `make_graphed_callables` with its static buffers
(`tests.models.cuda_graph_standin`); the GPU tests run torch's own."""

from __future__ import annotations

import pytest
import torch
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models import lora as L
from prime_models.layers import attention
from prime_models.layers.attention import row_packing, use_row_packing
from prime_models.parallel import compile as C
from prime_models.parallel import cuda_graphs as G
from prime_models.parallel.cuda_graphs import apply_cuda_graphs, cuda_graphs_of
from prime_models.parallel.mixed_precision import apply_mixed_precision, mixed_precision_of

from tests.models.conftest import VOCAB, tiny_config
from tests.models.cuda_graph_standin import graphs_on_cpu  # noqa: F401 (fixture)

ROWS, SEQ = 2, 17
# Two optimizer steps of two micro-batches: (seed, where the second sample of each row starts; 0 = unpacked).
STEPS = (((0, 0), (1, 7)), ((2, 11), (3, 0)))


def _batch(seed: int, split: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(SEQ).repeat(ROWS, 1)
    if split:
        pos[:, split:] -= split
    return ids.to(device), pos.to(device)


def _model(device: str, graphs: bool, parallel: dict | None = None, model_type: str = "qwen3"):
    model = load_model(tiny_config(model_type, num_hidden_layers=3), seed=0).to(device)
    get_model_spec(model_type).parallelize_fn(
        model, ParallelDims(world_size=1), param_dtype=torch.bfloat16, cuda_graphs=graphs, **(parallel or {})
    )
    return model


def _forward_backward(model, seed: int, split: int, device: str) -> float:
    ids, pos = _batch(seed, split, device)
    # Odd seeds pass the packing computed on the host (as the trainer does); even ones leave it to the forward.
    packing = row_packing(pos[:, :-1].cpu(), torch.device(device)) if seed % 2 else None
    with use_row_packing(packing):
        logprobs, entropy = model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])
    loss = -logprobs.mean() - 0.01 * entropy.mean()
    loss.backward()
    return loss.item()


def _train(device: str, graphs: bool, parallel: dict | None = None) -> dict:
    model = _model(device, graphs, parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = {"losses": [], "grads": [], "model": model}
    for step in STEPS:
        out["losses"] += [_forward_backward(model, seed, split, device) for seed, split in step]
        out["grads"].append({n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    return out


def _assert_trains_alike(eager: dict, graphed: dict, loss_rel: float, rtol: float, atol: float) -> None:
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=loss_rel)
    for step, (e, g) in enumerate(zip(eager["grads"], graphed["grads"], strict=True)):
        assert g.keys() == e.keys()
        for k, v in e.items():
            assert g[k].dtype == torch.float32  # the masters' gradients
            torch.testing.assert_close(g[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k, step=step: f"{k} {step}: {m}")
    for k, v in eager["params"].items():
        torch.testing.assert_close(graphed["params"][k], v, rtol=rtol, atol=atol, msg=k)


AC = {"none": dict(ac="none"), "full": dict(ac="full"), "selective": dict(ac="selective", ac_every=0)}


@pytest.mark.usefixtures("graphs_on_cpu")
@pytest.mark.parametrize("ac", list(AC))
def test_graphed_stack_trains_like_the_eager_one(ac):
    eager, graphed = _train("cpu", False, AC[ac]), _train("cpu", True, AC[ac])
    _assert_trains_alike(eager, graphed, loss_rel=1e-6, rtol=1e-5, atol=1e-7)
    graphs = cuda_graphs_of(graphed["model"])
    # One capture for unpacked rows, one for packed ones (two packings of the same shape share it).
    assert (graphs.captures, graphs.replays, len(graphs.graphs)) == (2, 4, 2)
    assert type(graphed["model"]).__name__ == "CudaGraphedQwen3ForCausalLM"
    assert [n for n, _ in graphed["model"].named_parameters()] == [n for n, _ in eager["model"].named_parameters()]


@pytest.mark.usefixtures("graphs_on_cpu")
def test_forwards_without_autograd_or_in_eval_mode_run_eagerly():
    model = _model("cpu", True)
    reference = _model("cpu", False)
    graphs = cuda_graphs_of(model)
    ids, pos = _batch(0, 7, "cpu")
    with torch.no_grad():
        assert torch.equal(model(ids, pos), reference(ids, pos))
    assert (graphs.captures, graphs.replays, graphs.last_eager_reason) == (0, 0, "no autograd")
    assert mixed_precision_of(model).computing is False  # the masters are back in place
    model.eval()
    model(ids, pos).sum().backward()
    assert (graphs.replays, graphs.last_eager_reason) == (0, "eval mode")
    model.train()
    model(ids, pos).sum().backward()
    assert (graphs.captures, graphs.replays) == (1, 1)


@pytest.mark.usefixtures("graphs_on_cpu")
def test_a_new_working_copy_is_captured_again():
    model = _model("cpu", True)
    graphs = cuda_graphs_of(model)
    _forward_backward(model, 0, 0, "cpu")
    _forward_backward(model, 2, 0, "cpu")
    assert (graphs.captures, graphs.replays) == (1, 2)
    apply_mixed_precision(model, torch.bfloat16)  # new working tensors: the old graph reads stale ones
    _forward_backward(model, 4, 0, "cpu")
    assert (graphs.captures, graphs.replays, len(graphs.graphs)) == (2, 3, 1)
    assert graphs.mixed_precision is mixed_precision_of(model)


@pytest.mark.usefixtures("graphs_on_cpu")
def test_every_gradient_is_handed_to_the_masters_before_the_next_replay():
    model = _model("cpu", True)
    _forward_backward(model, 0, 0, "cpu")
    mp = mixed_precision_of(model)
    assert all(w.grad is None for w in mp.working) and all(m.grad is not None for m in mp.masters)
    mp.working[1].grad = torch.zeros_like(mp.working[1])
    ids, pos = _batch(2, 0, "cpu")
    with pytest.raises(RuntimeError, match="still holds a gradient"):
        model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])


@pytest.mark.usefixtures("graphs_on_cpu")
def test_a_forward_before_the_previous_backward_runs_eagerly():
    def two_forwards_then_backwards(model) -> dict:
        losses = []
        for seed in (0, 2):
            ids, pos = _batch(seed, 0, "cpu")
            logprobs, _ = model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])
            losses.append(-logprobs.mean())
        sum(losses).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model = _model("cpu", True)
    grads = two_forwards_then_backwards(model)
    graphs = cuda_graphs_of(model)
    assert (graphs.replays, graphs.last_eager_reason) == (1, "an earlier graphed forward awaits its backward")
    for k, v in two_forwards_then_backwards(_model("cpu", False)).items():
        torch.testing.assert_close(grads[k], v, msg=k)
    _forward_backward(model, 4, 0, "cpu")  # the backward ran: graphs serve again
    assert graphs.replays == 2


@pytest.mark.usefixtures("graphs_on_cpu")
@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_capture_is_tried_again_then_its_rows_run_eagerly(failures, monkeypatch):
    """What an H100 once did to the compiled-layers test: cuBLAS failed inside a backward capture. One failure costs a
    second capture; two make the key's rows run eagerly, and the run trains as it would without graphs."""
    from tests.models.cuda_graph_standin import make_graphed_on_cpu

    attempts = []

    def flaky(module, sample_args, pool):
        attempts.append(len(attempts))
        if len(attempts) <= failures:
            raise torch.AcceleratorError("CUDA error: operation failed due to a previous error during capture")
        return make_graphed_on_cpu(module, sample_args, pool)

    monkeypatch.setattr(G, "make_graphed", flaky)
    graphed = _train("cpu", True)
    graphs = cuda_graphs_of(graphed["model"])
    if failures == 1:
        assert (len(attempts), graphs.captures, graphs.failed) == (3, 2, {})  # two keys, one captured twice
    else:
        assert (len(attempts), graphs.captures, len(graphs.graphs)) == (3, 1, 1)  # the first key gave up
        error = "CUDA error: operation failed due to a previous error during capture"
        ((_, packed, _),) = graphs.failed
        assert list(graphs.failed.values()) == [error]
        _forward_backward(graphed["model"], 8, 3 if packed else 0, "cpu")  # its rows again: eager, no new attempt
        assert (len(attempts), graphs.last_eager_reason) == (3, f"capture failed: {error}")
    _assert_trains_alike(_train("cpu", False), graphed, loss_rel=1e-6, rtol=1e-5, atol=1e-7)


def test_cuda_graphs_serve_only_the_one_rank_mixed_precision_path():
    with pytest.raises(ValueError, match="one-rank mixed precision"):
        apply_cuda_graphs(load_model(tiny_config("qwen3"), seed=0))  # fp32 compute: no working copy
    moe = load_model(tiny_config("qwen3_moe"), seed=0)
    apply_mixed_precision(moe, torch.bfloat16)
    with pytest.raises(ValueError, match="MoE"):
        apply_cuda_graphs(moe)
    lora = load_model(tiny_config("qwen3"), seed=0)
    L.apply_lora(lora, L.LoRASpec(rank=4, alpha=8.0), seed=1)
    apply_mixed_precision(lora, torch.bfloat16)
    with pytest.raises(ValueError, match="LoRA"):
        apply_cuda_graphs(lora)
    with pytest.raises(ValueError, match="one rank without FSDP2"):
        _model("cpu", True, dict(one_rank_fsdp=True))
    model = _model("cpu", True)
    assert apply_cuda_graphs(model) is cuda_graphs_of(model)  # idempotent
    assert type(model).__name__ == "CudaGraphedQwen3ForCausalLM"


def test_forwards_off_cuda_run_eagerly():
    model = _model("cpu", True)
    ids, pos = _batch(0, 0, "cpu")
    model(ids, pos).sum().backward()
    graphs = cuda_graphs_of(model)
    assert (graphs.captures, graphs.replays, graphs.last_eager_reason) == (0, 0, "rows on cpu")


# --- GPU: torch's make_graphed_callables ----------------------------------------------------------------------------


def _diagnostics(eager: dict, graphed: dict) -> str:
    diffs = [
        (k, (g[k] - v).abs().max().item())
        for e, g in zip(eager["grads"], graphed["grads"], strict=True)
        for k, v in e.items()
        if k in g
    ]
    worst = max(diffs, key=lambda kv: kv[1], default=None)
    graphs = cuda_graphs_of(graphed["model"])
    return (f"losses eager {eager['losses']} graphed {graphed['losses']}; largest gradient difference {worst}; "
            f"captures {graphs.captures} replays {graphs.replays} last eager reason {graphs.last_eager_reason}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "parallel",
    [dict(ac="none"), dict(ac="full"), dict(ac="selective", ac_every=0), dict(ac="full", compile_layers=True)],
    ids=["none", "full", "selective", "full_compiled"],
)
def test_cuda_graphs_on_a_gpu_train_like_eager(parallel, monkeypatch):
    if parallel.get("compile_layers"):
        monkeypatch.setattr(C, "COMPILE_BACKEND", "inductor")
        C._compiled_class.cache_clear()
    eager = _train("cuda", False, parallel)
    graphed = _train("cuda", True, parallel)
    print(_diagnostics(eager, graphed))
    graphs = cuda_graphs_of(graphed["model"])
    # Unpacked rows, and packed ones through the mask (seed 2: no host packing) and, where torch has it, through the
    # varlen kernel (seed 1: packing from the host).
    keys = 2 + attention.varlen_applies(torch.device("cuda"))
    assert (graphs.captures, graphs.replays) == (keys, 4), _diagnostics(eager, graphed)
    # The same kernels replayed: tolerances of the compiled layers' GPU test, which fuses and so rounds differently.
    _assert_trains_alike(eager, graphed, loss_rel=2e-2, rtol=0.1, atol=2e-3)
    # More micro-batches of both keys: replays only.
    for seed, split in ((5, 0), (6, 3), (7, 0)):
        _forward_backward(graphed["model"], seed, split, "cuda")
    assert (graphs.captures, graphs.replays) == (keys, 7), _diagnostics(eager, graphed)
    with torch.no_grad():
        ids, pos = _batch(8, 5, "cuda")
        graphed["model"](ids, pos, targets=ids)
    assert (graphs.replays, graphs.last_eager_reason) == (7, "no autograd")
