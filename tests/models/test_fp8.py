"""FP8 training (prime_models.quantization.float8): conversion filters, scaling math, numerics against high precision.

On CPU the tensorwise GEMMs run torch's real CPU `_scaled_mm`; rowwise and grouped GEMMs run the emulation
(dequantize + fp32 matmul), and the CUDA kernels' operand contracts (layouts, scale shapes) are checked by routing
the kernel calls through checkers. The gpu-marked tests compare the real CUDA kernels with the emulation.

Tolerances: e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per element), e5m2 2 bits (2^-3). Over a
matmul the errors partly average out; the measured relative errors (Frobenius norm) against fp32 with K=256 are
about 0.02-0.04 for outputs and 0.02-0.07 for gradients, so the bounds below are 0.06 and 0.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prime_models import ParallelDims, get_model_spec, load_model
from prime_models.layers.moe import GroupedExperts
from prime_models.quantization import float8
from prime_models.quantization import float8_ops as fp8
from torch import nn

from tests.models.conftest import VOCAB, tiny_config
from tests.ranks import leave_group

# Runs training processes: on the same xdist worker as the others (they oversubscribe 2 cores together).
pytestmark = pytest.mark.xdist_group("multiprocess")

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setattr(fp8, "FORCE_EMULATION", True)


# --- conversion ---------------------------------------------------------------------------------------------------


def test_converts_decoder_linears_only_and_keeps_parameters():
    model = load_model(tiny_config("qwen3", intermediate_size=40), seed=0)
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    converted = float8.convert_to_fp8(model, "tensorwise", skip=["*.layers.1.self_attn.o_proj"])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        assert isinstance(proj, fp8.Float8Linear) and proj.recipe.name == "tensorwise"
    # intermediate_size=40 is not a multiple of 16: the whole MLP stays in high precision.
    assert type(mlp.gate_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.o_proj) is nn.Linear  # skip pattern
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert converted == {"linear": 7, "experts": 0}
    # Same Parameter objects under the same names: optimizer, FSDP, checkpoints and HF export see no difference.
    assert list(model.state_dict()) == keys_before
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_converts_moe_experts_but_not_router():
    model = load_model(tiny_config("qwen3_moe"), seed=0)
    converted = float8.convert_to_fp8(model, "rowwise")
    moe = model.model.layers[0].mlp
    assert isinstance(moe.experts, fp8.Float8GroupedExperts)
    assert not isinstance(moe.gate, nn.Linear)  # the router keeps its own high-precision matmul
    assert converted == {"linear": 8, "experts": 2}
    model = load_model(tiny_config("qwen3_moe"), seed=0)
    assert float8.convert_to_fp8(model, "rowwise", moe=False) == {"linear": 8, "experts": 0}
    assert type(model.model.layers[0].mlp.experts) is GroupedExperts


def test_lora_wrapped_linears_and_their_adapters_stay_high_precision():
    from prime_core.config.shared import LoRAConfig
    from prime_models.lora import LoRASpec, apply_lora

    model = load_model(tiny_config("qwen3"), seed=0)
    apply_lora(model, LoRASpec.from_config(LoRAConfig(target_modules=["q_proj"])), ["a"], seed=0)
    converted = float8.convert_to_fp8(model, "tensorwise")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert not isinstance(q_proj, fp8.Float8Linear) and type(q_proj.lora_A["a"]) is nn.Linear
    assert converted == {"linear": 12, "experts": 0}


def test_none_recipe_is_a_no_op():
    model = load_model(tiny_config("qwen3"), seed=0)
    assert float8.convert_to_fp8(model, "none") == {}
    assert not any(isinstance(m, fp8.Float8Linear) for m in model.modules())


# --- scaling math ---------------------------------------------------------------------------------------------------


def test_tensorwise_scale_fills_the_fp8_range():
    x = torch.tensor([[0.5, -3.0], [2.0, 1.0]])
    q, s = fp8.quantize(x, fp8.E4M3)
    assert s.dim() == 0 and s.item() == pytest.approx(E4M3_MAX / 3.0)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max().item() == E4M3_MAX
    _, s5 = fp8.quantize(x, fp8.E5M2)
    assert s5.item() == pytest.approx(E5M2_MAX / 3.0)


def test_rowwise_scales_are_per_slice_powers_of_two():
    x = torch.tensor([[0.5, -3.0, 1.0], [2.0, 1.0, 0.25]])
    _, s_rows = fp8.quantize(x, fp8.E4M3, dim=-1, pow2=True)
    _, s_cols = fp8.quantize(x, fp8.E4M3, dim=0, pow2=True)
    assert s_rows.shape == (2, 1) and s_cols.shape == (1, 3)
    for s, amax in ((s_rows.flatten(), [3.0, 2.0]), (s_cols.flatten(), [2.0, 3.0, 1.0])):
        for si, a in zip(s.tolist(), amax, strict=True):
            # The largest power of two that keeps amax * scale within the e4m3 range.
            assert si == 2 ** int(torch.tensor(E4M3_MAX / a).log2().floor())
            assert si * a <= E4M3_MAX < 2 * si * a


def test_zero_tensor_quantizes_to_zero_with_finite_scale():
    q, s = fp8.quantize(torch.zeros(4, 16), fp8.E4M3, dim=-1, pow2=True)
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_quantize_dequantize_error_is_fp8_rounding():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3
    for dtype, mantissa_bits in ((fp8.E4M3, 3), (fp8.E5M2, 2)):
        q, s = fp8.quantize(x, dtype)
        back = fp8.dequantize(q, s)
        # Round-to-nearest: relative error <= 2^-(m+1) for normal values; tiny values hit the subnormal floor.
        tiny = torch.finfo(dtype).smallest_normal / s
        assert ((back - x).abs() <= x.abs() * 2 ** -(mantissa_bits + 1) + tiny).all()


def test_saturates_instead_of_overflowing():
    # A scale computed on another tensor (as the weight-gradient operands can see) must clamp, not produce NaN/inf.
    q = fp8._quantize(torch.tensor([1.0, 1e6]), fp8.E4M3, None, False)[0]
    assert torch.isfinite(q.float()).all()


# --- numerics -------------------------------------------------------------------------------------------------------


def _linear_case(bias: bool, seed: int = 0, rows: int = 37):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(256, 128, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(128, generator=g))
    x = torch.randn(2, rows, 256, generator=g, requires_grad=True)
    grad = torch.randn(2, rows, 128, generator=g)
    return lin, x, grad


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    y = module(x)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(y, [x, *params], grad)
    return [y.detach(), *grads]


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_close_to_high_precision(recipe, bias):
    lin, x, grad = _linear_case(bias)
    ref = _fwd_bwd(lin, x, grad)
    out = _fwd_bwd(fp8.Float8Linear.from_linear(lin, fp8.get_recipe(recipe)), x, grad)
    errors = [rel(a, b) for a, b in zip(out, ref, strict=True)]
    print(recipe, "relative errors (y, grad_x, grad_w[, grad_b])", errors)
    assert errors[0] < 0.06 and max(errors[1:3]) < 0.1
    if bias:
        assert errors[3] < 1e-6  # the bias gradient never goes through FP8


def test_tensorwise_cpu_kernel_equals_emulation(monkeypatch):
    lin, x, grad = _linear_case(bias=False)
    f = fp8.Float8Linear.from_linear(lin, fp8.get_recipe("tensorwise"))
    real = _fwd_bwd(f, x, grad)
    monkeypatch.setattr(fp8, "FORCE_EMULATION", True)
    emulated = _fwd_bwd(f, x, grad)
    for a, b in zip(real, emulated, strict=True):
        assert rel(a, b) < 1e-6  # fp32 summation order only


def test_frozen_weight_gets_no_gradient():
    lin, x, grad = _linear_case(bias=False)
    lin.weight.requires_grad_(False)
    y = fp8.Float8Linear.from_linear(lin, fp8.get_recipe("rowwise"))(x)
    (gx,) = torch.autograd.grad(y, [x], grad)
    assert lin.weight.grad is None and gx.shape == x.shape


def _check_scaled_mm_call(calls):
    """A stand-in for CUDA's `torch._scaled_mm` that enforces its documented operand contract, then emulates."""

    def fake(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
        assert a.dtype in (fp8.E4M3, fp8.E5M2) and b.dtype in (fp8.E4M3, fp8.E5M2)
        assert a.stride(1) == 1 and a.stride(0) >= a.shape[1], f"a must be row-major, strides {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= b.shape[0], f"b must be column-major, strides {b.stride()}"
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scale_a.numel() == 1 and scale_b.numel() == 1:
            assert scale_a.dim() == scale_b.dim() == 0
        else:
            assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
            assert out_dtype == torch.bfloat16, "rowwise scaling only writes bf16"
            assert a.dtype == b.dtype == fp8.E4M3
        calls.append((tuple(a.shape), tuple(b.shape), use_fast_accum))
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    return fake


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_kernel_operands_meet_scaled_mm_contract(recipe, monkeypatch):
    # 37 rows per sample: the token dimension (contracted in the weight gradient) is not a multiple of 16.
    lin, x, grad = _linear_case(bias=False, rows=37)
    calls = []
    monkeypatch.setattr(fp8, "_use_scaled_mm", lambda a, tensorwise: True)
    monkeypatch.setattr(torch, "_scaled_mm", _check_scaled_mm_call(calls))
    out = _fwd_bwd(fp8.Float8Linear.from_linear(lin, fp8.get_recipe(recipe)), x, grad)
    assert [c[2] for c in calls] == [True, False, False]  # fast accumulation for the output GEMM only
    monkeypatch.setattr(fp8, "FORCE_EMULATION", True)
    monkeypatch.setattr(fp8, "_use_scaled_mm", lambda a, tensorwise: False)
    emulated = _fwd_bwd(fp8.Float8Linear.from_linear(lin, fp8.get_recipe(recipe)), x, grad)
    for a, b in zip(out, emulated, strict=True):
        assert rel(a, b) < 1e-2  # the stand-in rounds rowwise outputs to bf16


def _grouped_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([21, 0, 40, 3])  # an empty expert and groups that are not multiples of 16
    w_ENK = (torch.randn(4, 48, 64, generator=g) * 0.05).requires_grad_()
    x = torch.randn(int(counts.sum()), 64, generator=g, requires_grad=True)
    grad = torch.randn(x.shape[0], 48, generator=g)
    return counts, w_ENK, x, grad


def _grouped_fwd_bwd(fn, x, w_ENK, counts, grad):
    y = fn(x, w_ENK.transpose(-2, -1), counts)
    return [y.detach(), *torch.autograd.grad(y, [x, w_ENK], grad)]


def test_fp8_grouped_mm_close_to_high_precision():
    from prime_models import kernels

    counts, w, x, grad = _grouped_case()
    offs = counts.cumsum(0).to(torch.int32)
    ref = _grouped_fwd_bwd(lambda a, b, c: kernels.grouped_mm(a, b, c, offs), x, w, counts, grad)
    out = _grouped_fwd_bwd(fp8.fp8_grouped_mm, x, w, counts, grad)
    errors = [rel(a, b) for a, b in zip(out, ref, strict=True)]
    print("grouped relative errors (y, grad_x, grad_w)", errors)
    assert errors[0] < 0.06 and max(errors[1:]) < 0.1


def test_grouped_kernel_operands_meet_scaled_grouped_mm_contract(monkeypatch):
    counts, w, x, grad = _grouped_case()
    expected = _grouped_fwd_bwd(fp8.fp8_grouped_mm, x, w, counts, grad)
    calls = []

    def checked(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        # torch's meta kernel carries the CUDA kernel's checks (strides, dtypes, scale shapes, offsets).
        meta = [t.to("meta") if t.dtype != torch.float8_e4m3fn else torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (a, b, scale_a, scale_b)]  # fmt: skip
        torch._scaled_grouped_mm(*meta, offs=offs.to("meta"), out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        assert offs.dtype == torch.int32 and (offs % 16 == 0).all()
        calls.append((a.dim(), b.dim()))
        return fp8._grouped_mm_emulated(a, scale_a, b, scale_b, offs)

    monkeypatch.setattr(fp8, "scaled_grouped_mm_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _forward_meta_or(checked), raising=False)
    out = _grouped_fwd_bwd(fp8.fp8_grouped_mm, x, w, counts, grad)
    assert calls == [(2, 3), (2, 3), (2, 2)]
    for a, b in zip(out, expected, strict=True):
        assert (a - b).abs().max().item() == 0


def _forward_meta_or(fn):
    real = torch._scaled_grouped_mm

    def dispatch(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False, **kw):
        if a.device.type == "meta":
            return real(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        return fn(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum)

    return dispatch


# --- model-level ----------------------------------------------------------------------------------------------------

STEPS, BATCH, SEQ = 6, 4, 33


def _batches():
    g = torch.Generator().manual_seed(123)
    # A repeating pattern the model can learn quickly, so losses fall step over step.
    base = torch.randint(0, VOCAB, (BATCH, 8), generator=g)
    return [base.repeat(1, SEQ // 8 + 1)[:, :SEQ]] * STEPS


def _train(
    rank: int, world: int, model_type: str, recipe: str, init_file: str, out_dir: str, steps: int = STEPS
) -> list[float]:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = load_model(tiny_config(model_type), seed=0)
        float8.convert_to_fp8(model, recipe)
        get_model_spec(model_type).parallelize_fn(model, ParallelDims(world_size=world), ac="full")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        per_rank = BATCH // world
        losses = []
        for ids in _batches()[:steps]:
            ids = ids[rank * per_rank : (rank + 1) * per_rank]
            logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
            loss = -logprobs.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
        if rank == 0:
            with open(f"{out_dir}/losses_{recipe}_ws{world}.json", "w") as f:
                json.dump(losses, f)
        return losses
    finally:
        if world > 1:
            leave_group()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fp8_training_tracks_high_precision(model_type, tmp_path):
    ref = _train(0, 1, model_type, "none", "", str(tmp_path))
    for recipe in fp8.RECIPES:
        out = _train(0, 1, model_type, recipe, "", str(tmp_path))
        diffs = [abs(a - b) / b for a, b in zip(out, ref, strict=True)]
        print(f"{model_type} {recipe}: fp32 {ref}\n  fp8 {out}\n  max relative diff {max(diffs):.3e}")
        assert out[-1] < 0.75 * out[0]
        assert max(diffs) < 0.03


@pytest.mark.integration
def test_fsdp2_two_ranks_train_converted_model(tmp_path):
    single = _train(0, 1, "qwen3_moe", "tensorwise", "", str(tmp_path), 4)
    args = (2, "qwen3_moe", "tensorwise", str(tmp_path / "init"), str(tmp_path), 4)
    mp.spawn(_train, args=args, nprocs=2, join=True)
    sharded = json.loads((tmp_path / "losses_tensorwise_ws2.json").read_text())
    diffs = [abs(a - b) / b for a, b in zip(single, sharded, strict=True)]
    print(f"fp8 losses 1 proc {single}\n  2 procs {sharded}\n  max relative diff {max(diffs):.2e}")
    # Not bit-equal: tensorwise scales of activations depend on each rank's share of the batch.
    assert sharded[-1] < 0.9 * sharded[0]
    assert max(diffs) < 0.03


# --- configuration and errors ---------------------------------------------------------------------------------------


def test_config_rejects_unknown_recipe_naming_the_field():
    from prime_core.config import parse_cli
    from prime_core.config.shared import ModelConfig
    from prime_core.config.trainer import TrainerConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fp8.recipe"):
        ModelConfig(fp8={"recipe": "blockwise"})
    # A local model directory: the hub default would be checked for reachability, which CI has not.
    base = str(Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "base")
    cfg = parse_cli(
        TrainerConfig,
        ["--model.name", base, "--model.fp8.recipe", "rowwise", "--model.fp8.skip", '["*.o_proj"]'],
        prog="trainer",
    )
    assert cfg.model.fp8.recipe == "rowwise" and cfg.model.fp8.skip == ["*.o_proj"]


def test_unsupported_gpu_fails_with_one_line_naming_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"model\.fp8\.recipe='tensorwise' needs an FP8 GPU.*sm80") as err:
        float8.check_fp8_device(torch.device("cuda", 0), "tensorwise")
    assert "\n" not in str(err.value)


def test_bad_recipe_and_backend_errors():
    model = load_model(tiny_config("qwen3"), seed=0)
    with pytest.raises(ValueError, match="model.fp8.recipe='fp4'"):
        float8.convert_to_fp8(model, "fp4")
    with pytest.raises(ValueError, match="model.fp8.backend='cuda'"):
        float8.convert_to_fp8(model, "tensorwise", backend="cuda")


@pytest.mark.skipif(float8.importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
def test_te_backend_without_te_names_the_extra():
    model = load_model(tiny_config("qwen3"), seed=0)
    assert float8.resolve_backend("auto") == "torch"
    with pytest.raises(ImportError, match=r"prime-models\[fp8\]"):
        float8.convert_to_fp8(model, "tensorwise", backend="te")


# --- GPU ------------------------------------------------------------------------------------------------------------


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_gpu_scaled_mm_equals_emulation(recipe, monkeypatch):
    lin, x, grad = _linear_case(bias=True, rows=1000)
    lin = lin.cuda().bfloat16()
    x = x.detach().cuda().bfloat16().requires_grad_()
    grad = grad.cuda().bfloat16()
    f = fp8.Float8Linear.from_linear(lin, fp8.get_recipe(recipe))
    real = _fwd_bwd(f, x, grad)
    monkeypatch.setattr(fp8, "FORCE_EMULATION", True)
    emulated = _fwd_bwd(f, x, grad)
    errors = [rel(a, b) for a, b in zip(real, emulated, strict=True)]
    print(recipe, "kernel vs emulation", errors)
    # Same quantized operands; differences are accumulation order, fast accumulation and the bf16 output rounding.
    assert max(errors) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)), reason="sm90+")
def test_gpu_scaled_grouped_mm_equals_emulation(monkeypatch):
    counts, w, x, grad = _grouped_case()
    counts, grad = counts.cuda(), grad.cuda().bfloat16()
    w = w.detach().cuda().bfloat16().requires_grad_()
    x = x.detach().cuda().bfloat16().requires_grad_()
    real = _grouped_fwd_bwd(fp8.fp8_grouped_mm, x, w, counts, grad)
    monkeypatch.setattr(fp8, "FORCE_EMULATION", True)
    emulated = _grouped_fwd_bwd(fp8.fp8_grouped_mm, x, w, counts, grad)
    errors = [rel(a, b) for a, b in zip(real, emulated, strict=True)]
    print("grouped kernel vs emulation", errors)
    assert max(errors) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.skipif(float8.importlib.util.find_spec("transformer_engine") is None, reason="needs transformer-engine")
def test_gpu_te_backend_close_to_bf16():
    lin, x, grad = _linear_case(bias=False, rows=1024)
    lin = lin.cuda().bfloat16()
    x = x.detach().cuda().bfloat16().requires_grad_()
    ref = _fwd_bwd(lin, x, grad.cuda().bfloat16())
    te_lin = float8.te_linear(lin, "tensorwise")
    assert te_lin.weight is lin.weight and "_extra_state" not in "".join(te_lin.state_dict())
    out = _fwd_bwd(te_lin, x, grad.cuda().bfloat16())
    errors = [rel(a, b) for a, b in zip(out, ref, strict=True)]
    print("te vs bf16", errors)
    assert errors[0] < 0.06 and max(errors[1:]) < 0.1
