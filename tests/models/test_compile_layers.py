"""``parallel.compile_layers``: each decoder layer's forward compiled (`prime_models.parallel.compile`) trains like the
eager layers, under every activation checkpointing mode and on the one-rank bf16 path, with one graph for all layers.

The backend is ``aot_eager`` (the graph capture and AOT autograd that inductor compiles; inductor's C++ build on a
small CPU host takes minutes): losses and gradients then match eager ones up to the backward's formulas."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models.models.transformer import DecoderLayer
from prime_models.parallel import compile as C
from prime_models.parallel.activation_checkpoint import apply_activation_checkpointing, layer_checkpoint
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters, guard_failures

from tests.models.conftest import VOCAB, tiny_config

ROWS, SEQ = 2, 17


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(C, "COMPILE_BACKEND", "aot_eager")
    C._compiled_class.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    yield
    C._compiled_class.cache_clear()
    torch._dynamo.reset()


def _layer_graphs() -> tuple[int, str]:
    """How many graphs dynamo holds for the decoder layer's forward (one per set of guards: each recompile adds one),
    and a diagnostic: why it recompiled, and what broke graphs. Unlike ``counters["stats"]["unique_graphs"]`` this
    leaves out every other compiled function: on a GPU the eager path's own `kernels.cuda_compiled` elementwise ops
    (RMSNorm at three shapes, rotary at two, the SwiGLU gate) and the fused log-prob head's two kernels, 8 graphs that
    made that count 10 on an H100 with the layer's own 2."""
    code = DecoderLayer.forward.__code__
    reasons = guard_failures.get(code, [])
    why = f"recompiles: {reasons}; graph breaks: {dict(counters['graph_break'])}; stats: {dict(counters['stats'])}"
    return len(_debug_get_cache_entry_list(code)), why


def _batch(seed: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(SEQ).repeat(ROWS, 1)
    if packed:
        pos[:, 7:] -= 7  # two samples a row: attention through a mask
    return ids, pos


def _train(parallel: dict, compiled: bool, param_dtype=None, model_type: str = "qwen3") -> dict:
    model = load_model(tiny_config(model_type, num_hidden_layers=3), seed=0)
    get_model_spec(model_type).parallelize_fn(
        model, ParallelDims(world_size=1), param_dtype=param_dtype, compile_layers=compiled, **parallel
    )
    out = {"losses": [], "grads": {}}
    for i, packed in enumerate((False, True, False)):
        ids, pos = _batch(i, packed)
        logprobs, entropy = model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])
        loss = -logprobs.mean() - 0.01 * entropy.mean()
        loss.backward()
        out["losses"].append(loss.item())
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["model"] = model
    return out


AC = {
    "none": dict(ac="none"),
    "full": dict(ac="full"),
    "full_keep_offload": dict(ac="full", ac_keep_attention=-1, ac_offload_attention=True),
    "selective": dict(ac="selective", ac_every=0),
    # The chunked MLP runs eagerly between two graphs of each layer (dynamo does not trace its node).
    "full_mlp_chunks": dict(ac="full", ac_mlp_chunks=2),
}


@pytest.mark.parametrize("name", list(AC))
def test_compiled_layers_train_like_eager_ones(name):
    eager, compiled = _train(AC[name], compiled=False), _train(AC[name], compiled=True)
    layers = compiled["model"].model.layers
    assert all(C.is_compiled(layer) for layer in layers)
    assert all(type(layer).__name__.endswith("CompiledDecoderLayer") for layer in layers)
    assert [n for n, _ in compiled["model"].named_parameters()] == [n for n, _ in eager["model"].named_parameters()]
    # One graph for every layer, a second for packed rows (their attention mask): no recompile per layer. On CPU
    # nothing else compiles, so the count of every graph also holds the graph breaks.
    layer_graphs, why = _layer_graphs()
    assert layer_graphs == 2, why
    graphs_a_layer = 2 if AC[name].get("ac_mlp_chunks") else 1
    assert counters["stats"]["unique_graphs"] <= 2 * graphs_a_layer, why
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["grads"].keys() == eager["grads"].keys()
    for k, v in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_compiled_layers_on_the_one_rank_bf16_path():
    eager = _train(dict(ac="none"), compiled=False, param_dtype=torch.bfloat16)
    compiled = _train(dict(ac="none"), compiled=True, param_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in compiled["model"].parameters())
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-2)
    for k, v in eager["grads"].items():
        assert compiled["grads"][k].dtype == torch.float32
        torch.testing.assert_close(compiled["grads"][k], v, rtol=0.05, atol=1e-3, msg=k)


def test_compiling_comes_before_checkpointing():
    model = load_model(tiny_config("qwen3"), seed=0)
    layers = model.model.layers
    C.compile_layers(layers)
    C.compile_layers(layers)  # idempotent
    apply_activation_checkpointing(layers, "full")
    assert all(C.is_compiled(layer) and layer_checkpoint(layer) is not None for layer in layers)
    other = load_model(tiny_config("qwen3"), seed=0)
    apply_activation_checkpointing(other.model.layers, "full")
    with pytest.raises(ValueError, match="before activation checkpointing"):
        C.compile_layer(other.model.layers[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ac", ["none", "full"])
def test_inductor_compiled_layers_on_a_gpu_train_like_eager_ones(monkeypatch, ac):
    """What `parallel.compile_layers` runs on a GPU: inductor's kernels, bf16 compute over fp32 masters."""
    monkeypatch.setattr(C, "COMPILE_BACKEND", "inductor")
    C._compiled_class.cache_clear()
    results = []
    for compiled in (False, True):
        model = load_model(tiny_config("qwen3", num_hidden_layers=3), seed=0).cuda()
        get_model_spec("qwen3").parallelize_fn(
            model, ParallelDims(world_size=1), param_dtype=torch.bfloat16, compile_layers=compiled, ac=ac
        )
        losses = []
        for i, packed in enumerate((False, True, False)):
            ids, pos = (t.cuda() for t in _batch(i, packed))
            logprobs, _ = model(ids[:, :-1], pos[:, :-1], targets=ids[:, 1:])
            loss = -logprobs.mean()
            loss.backward()
            losses.append(loss.item())
        results.append((losses, {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_losses, eager_grads), (losses, grads) = results
    assert losses == pytest.approx(eager_losses, rel=2e-2)
    layer_graphs, why = _layer_graphs()
    assert layer_graphs == 2, why
    for k, v in eager_grads.items():
        torch.testing.assert_close(grads[k], v, rtol=0.1, atol=2e-3, msg=k)
