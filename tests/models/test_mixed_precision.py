"""The one-rank path (bf16 working copy over fp32 masters, no FSDP) trains exactly like FSDP2 on one rank with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: losses, gradients and parameters, on CPU in bf16."""

from __future__ import annotations

import pytest
import torch
from prime_core.config.shared import Fp8Config
from prime_models import ParallelDims, get_model_spec, hf_state_dict, load_model
from prime_models import lora as L
from prime_models.parallel.mixed_precision import apply_mixed_precision, mixed_precision_of
from prime_trainer.optim import clip_grad_norm
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.models.conftest import VOCAB, tiny_config

STEPS, MICRO_BATCHES, ROWS, SEQ = 2, 2, 2, 17


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _batches(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(MICRO_BATCHES)]


VARIANTS = {
    "dense_full_ac": dict(model_type="qwen3", parallel=dict(ac="full")),
    "tied_keep_offload_chunks": dict(
        model_type="qwen3",
        config=dict(tie_word_embeddings=True),
        parallel=dict(ac="full", ac_keep_attention=-1, ac_offload_attention=True, ac_mlp_chunks=2),
    ),
    # (MoE is left out: FSDP2's bf16 unsharded experts fail in `GroupedExperts` on CPU, the reference cannot run.)
    "llama_selective": dict(model_type="llama", parallel=dict(ac="selective", ac_every=0)),
    "lora": dict(model_type="qwen3", lora=True, parallel=dict(ac="full")),
    "fp8": dict(model_type="qwen3", parallel=dict(fp8=Fp8Config(recipe="tensorwise"))),
}


def _train(variant: dict, fsdp: bool) -> dict:
    model = load_model(tiny_config(variant["model_type"], **variant.get("config", {})), seed=0)
    if variant.get("lora"):
        L.apply_lora(model, L.LoRASpec(rank=4, alpha=8.0), seed=1)
        with torch.no_grad():  # B = 0 would leave the adapters' A without gradients
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    get_model_spec(variant["model_type"]).parallelize_fn(
        model, ParallelDims(world_size=1), param_dtype=torch.bfloat16, one_rank_fsdp=fsdp, **variant["parallel"]
    )
    assert isinstance(model, FSDPModule) == fsdp and (mixed_precision_of(model) is None) == fsdp
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    out = {"losses": [], "grads": [], "norms": []}
    for step in range(STEPS):
        for i, ids in enumerate(_batches(step)):
            if fsdp:
                model.set_requires_gradient_sync(i == MICRO_BATCHES - 1)
            logprobs, entropy = model(ids[:, :-1], targets=ids[:, 1:])
            loss = -logprobs.mean() - 0.01 * entropy.mean()
            loss.backward()
            out["losses"].append(loss.item())
        out["norms"].append(clip_grad_norm(model, 1.0))
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    out["model"] = model
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_rank_path_trains_like_fsdp2_on_one_rank(name):
    fsdp, plain = _train(VARIANTS[name], fsdp=True), _train(VARIANTS[name], fsdp=False)
    assert plain["losses"] == fsdp["losses"]
    assert plain["norms"] == pytest.approx(fsdp["norms"], rel=1e-6)
    for step, (a, b) in enumerate(zip(plain["grads"], fsdp["grads"], strict=True)):
        assert a.keys() == b.keys() and a
        for k in a:
            assert a[k].dtype == b[k].dtype == torch.float32, k
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k, s=step: f"{k} step {s}: {m}")
    assert plain["params"].keys() == fsdp["params"].keys()
    for k, v in plain["params"].items():
        assert v.dtype == torch.float32, k
        # Clipping scales by the norm, which FSDP reduces over DTensor shards: float rounding of the last bit.
        torch.testing.assert_close(v, fsdp["params"][k], rtol=1e-6, atol=1e-7, msg=k)
    if VARIANTS[name].get("lora"):
        trained = {k for k, v in plain["grads"][0].items()}
        assert trained and all(L.is_adapter_param(k) for k in trained)
    # The HF export reads the fp32 masters, under the same names as FSDP2's export.
    a = dict(hf_state_dict(plain["model"]))
    b = dict(hf_state_dict(fsdp["model"]))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


def test_masters_at_rest_working_copy_inside_forward_and_backward():
    model = load_model(tiny_config("qwen3", tie_word_embeddings=True), seed=0)
    names = [n for n, _ in model.named_parameters()]
    mp = apply_mixed_precision(model, torch.bfloat16)
    assert mp.num_bytes == sum(p.numel() for p in model.parameters()) * 2
    assert [n for n, _ in model.named_parameters()] == names
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))

    # A forward without autograd leaves the masters in place.
    with torch.no_grad():
        model(ids)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    # With autograd the working copy stays until the backward ends (activation checkpointing recomputes with it); a
    # state dict read in between still sees the masters.
    logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
    assert logprobs.dtype == torch.float32
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
    logprobs.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(w.grad is None for w in mp.working)

    # An in-place update of the masters (an optimizer step, a checkpoint load) reaches the next forward.
    before = model(ids).detach()
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    after = model(ids).detach()
    assert not torch.equal(before, after)
    assert torch.equal(mp.working[names.index("model.norm.weight")].float(), model.model.norm.weight)


def test_float_inputs_are_cast_to_the_compute_dtype_as_fsdp2_does():
    # FSDP2's cast_forward_inputs: floating-point tensors among the root's inputs (a VLM's pixel_values) become bf16.
    model = load_model(tiny_config("qwen3"), seed=0)
    mp = apply_mixed_precision(model, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 5))
    args, kwargs = mp.pre_forward(model, (ids, torch.ones(2)), {"pixel_values": torch.ones(2), "grid": [torch.ones(1)]})
    mp.use_masters()
    assert args[0].dtype == torch.int64 and args[1].dtype == torch.bfloat16
    assert kwargs["pixel_values"].dtype == kwargs["grid"][0].dtype == torch.bfloat16


def test_parallelize_picks_the_one_rank_path():
    spec = get_model_spec("qwen3")
    # fp32 compute (the CPU default) needs no working copy; cpu_offload on CPU changes nothing either.
    plain = spec.parallelize_fn(load_model(tiny_config("qwen3"), seed=0), ParallelDims(world_size=1), cpu_offload=True)
    assert mixed_precision_of(plain) is None and not isinstance(plain, FSDPModule)
    bf16 = load_model(tiny_config("qwen3"), seed=0, dtype=torch.bfloat16)
    spec.parallelize_fn(bf16, ParallelDims(world_size=1), param_dtype=torch.bfloat16)
    assert mixed_precision_of(bf16) is None  # bf16 masters compute as they are


@pytest.mark.parametrize("fused", [False, True])
def test_the_working_copy_follows_every_optimizer_step_even_a_fused_one(fused):
    """Fused AdamW (the trainer's optimizer on CUDA) updates its parameters without moving their version counters:
    the working copy must still be refreshed after each step, or every forward computes with the first weights while
    the masters (what inference is sent) move on. The optimizer here is built by the caller, not by prime."""
    model = load_model(tiny_config("qwen3"), seed=0)
    mp = apply_mixed_precision(model, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True if fused else None)
    ids = _batches(0)[0]
    for _ in range(2):
        versions = [m._version for m in mp.masters]
        logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fused:  # what made this a bug: nothing but the optimizer's step says the masters moved
            assert [m._version for m in mp.masters] == versions
        model(ids[:, :-1], targets=ids[:, 1:])[0].sum().backward()  # a forward refreshes the copy; drop its grads
        model.zero_grad(set_to_none=True)
        for working, master in zip(mp.working, mp.masters, strict=True):
            torch.testing.assert_close(working.detach(), master.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_only_steps_of_an_optimizer_holding_a_master_mark_the_copy_stale():
    model = load_model(tiny_config("qwen3"), seed=0)
    mp = apply_mixed_precision(model, torch.bfloat16)
    other = nn.Linear(4, 4)
    other(torch.randn(2, 4)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    assert not mp.stale
    torch.optim.SGD(list(model.parameters())[-1:], lr=0.1).step()
    assert mp.stale
    mp.remove()  # unregisters the process-wide hook with the others
    mp.stale = False
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not mp.stale
