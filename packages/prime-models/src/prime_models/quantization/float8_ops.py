"""FP8 kernels: dynamic quantization, the scaled GEMMs of a linear layer and of MoE experts, and the modules that
use them (`Float8Linear`, `Float8GroupedExperts`). `prime_models.quantization.float8` swaps them into a model.

Scaling is dynamic: every operand is quantized right before its GEMM with ``scale = fp8_max / amax`` computed from
the tensor itself (no amax history), so a step never depends on earlier steps. The recipes follow torchao.float8's
recipes of the same name:

* ``tensorwise``: one scale per tensor. `input` and `weight` in e4m3 (max 448), `grad_output` in e5m2 (max 57344,
  more range for gradients). The output GEMM uses fast (lower-precision) accumulation, the two gradient GEMMs full
  fp32 accumulation. Fastest (cuBLAS tensorwise kernel).
* ``rowwise``: one scale per row of each GEMM operand along the contracted dimension (``input`` per token for the
  output, per feature for the weight gradient; ``weight`` per output feature for the output, per input feature for
  the input gradient; ``grad_output`` likewise), all operands e4m3, scales rounded down to a power of two so
  rescaling is exact. More accurate than tensorwise, a little slower (CUTLASS rowwise kernel).

MoE experts (`torch._scaled_grouped_mm`, sm90+) always use rowwise e4m3 scales with power-of-two rounding, whatever
the recipe (the grouped kernel takes no other scaling); each expert's token group is zero-padded to a multiple of 16
rows as the kernel requires.

Kernels: `torch._scaled_mm` on CUDA (compute capability >= 8.9). On CPU, where torch implements only tensorwise
scaling, tensorwise runs the real CPU kernel and everything else runs the emulation: the same quantized operands
dequantized into an fp32 matmul, which is also the reference the GPU tests compare the kernels against. CPU FP8 is
for tests, not speed.

Shape legend: M rows (tokens), K contracted features, N output features, E experts, P padded rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from prime_models import kernels
from prime_models.layers.moe import GroupedExperts

RECIPES = ("tensorwise", "rowwise")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Keeps the scale finite for an all-zero tensor (its quantized values are 0 whatever the scale).
AMAX_EPS = 1e-12
# FP8 GEMMs need both dimensions of the weight (K and N) to be multiples of 16; the token dimension is padded.
ALIGN = 16
# Tests set this to run the emulation on every device (the reference the real kernels are checked against).
FORCE_EMULATION: bool = False


@dataclass(frozen=True)
class Fp8Recipe:
    """How the three GEMMs of a linear layer quantize their operands."""

    name: str
    rowwise: bool
    grad_dtype: torch.dtype
    pow2_scales: bool
    fast_accum_output: bool = True


def get_recipe(name: str) -> Fp8Recipe:
    if name == "tensorwise":
        return Fp8Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, pow2_scales=False)
    if name == "rowwise":
        return Fp8Recipe("rowwise", rowwise=True, grad_dtype=E4M3, pow2_scales=True)
    raise ValueError(f"model.fp8.recipe={name!r}: expected one of {RECIPES} (or 'none')")


# --- quantization ---------------------------------------------------------------------------------------------------


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """fp32 scale with ``x * scale`` filling the FP8 range; float64 math so compiled and eager scales agree."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool):
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax_to_scale(amax, dtype, pow2)
    fp8_max = torch.finfo(dtype).max
    # Eager casts to FP8 in torch 2.11 do not saturate, so clamp first.
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype), scale


@functools.cache
def _compiled_quantize():
    # One fused amax + scale + cast kernel pair instead of ~6 passes; dynamic shapes so the many (tokens, features)
    # shapes of a model share one graph per (dtype, dim, pow2) instead of exhausting dynamo's recompile limit.
    return torch.compile(_quantize, dynamic=True)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2: bool = False):
    """Dynamic FP8 quantization: returns ``(x_fp8, scale)`` with ``x ~= x_fp8 / scale``.

    `dim=None` gives one scale per tensor (a 0-d tensor); otherwise the amax is taken along `dim` (kept as size 1),
    i.e. one scale per slice orthogonal to `dim`. Values are saturated to the FP8 range before the cast.
    """
    if x.is_cuda and kernels.COMPILE_ON_CUDA:
        return _compiled_quantize()(x, dtype, dim, pow2)
    return _quantize(x, dtype, dim, pow2)


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() / scale


# --- GEMMs ------------------------------------------------------------------------------------------------------------


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return (
        t if t.stride(-2) == 1 and t.stride(-1) >= t.shape[-2] else t.transpose(-2, -1).contiguous().transpose(-2, -1)
    )


def _use_scaled_mm(a: torch.Tensor, tensorwise: bool) -> bool:
    return not FORCE_EMULATION and (a.is_cuda or tensorwise)


def scaled_mm(
    a_MK: torch.Tensor,
    a_scale: torch.Tensor,
    b_KN: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` from FP8 operands and their quantization scales.

    Scales are 0-d (tensorwise) or ``a_scale [M, 1]`` / ``b_scale [1, N]`` (rowwise). Runs `torch._scaled_mm` where
    it supports the operands (CUDA; CPU with tensorwise scales), otherwise the fp32 emulation.
    """
    tensorwise = a_scale.numel() == 1 and b_scale.numel() == 1
    if not _use_scaled_mm(a_MK, tensorwise):
        return ((a_MK.float() @ b_KN.float()) / a_scale / b_scale).to(out_dtype)
    # The kernel wants the inverse (dequantization) scales, `a` row-major and `b` column-major.
    kernel_dtype = out_dtype if tensorwise or out_dtype == torch.bfloat16 else torch.bfloat16
    out = torch._scaled_mm(
        _row_major(a_MK),
        _col_major(b_KN),
        scale_a=a_scale.reciprocal().reshape(a_scale.shape if a_scale.dim() == 2 else ()),
        scale_b=b_scale.reciprocal().reshape(b_scale.shape if b_scale.dim() == 2 else ()),
        out_dtype=kernel_dtype,
        use_fast_accum=fast_accum,
    )
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int = ALIGN) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    if extra == 0:
        return t
    if t.dtype in (E4M3, E5M2):
        # Pad FP8 through its bytes (0x00 is +0.0 in both formats): not every op has FP8 kernels.
        raw = t.view(torch.uint8)
        return torch.cat([raw, raw.new_zeros(extra, *t.shape[1:])]).view(t.dtype)
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


class _Fp8Matmul(torch.autograd.Function):
    """``y = x @ w.T`` with all three GEMMs (output, grad input, grad weight) in FP8."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.recipe = recipe
        if recipe.rowwise:
            x_q, x_s = quantize(x_MK, E4M3, -1, recipe.pow2_scales)
            w_q, w_s = quantize(w_NK, E4M3, -1, recipe.pow2_scales)
            # The weight-gradient GEMM scales `x` along the other axis, so the high-precision input is kept.
            ctx.save_for_backward(x_MK, w_NK)
            return scaled_mm(x_q, x_s, w_q.t(), w_s.t(), x_MK.dtype, recipe.fast_accum_output)
        x_q, x_s = quantize(x_MK, E4M3)
        w_q, w_s = quantize(w_NK, E4M3)
        # Tensorwise: backward would quantize `x` to the same bits, so keep those (half of bf16's bytes). The weight
        # is requantized in backward instead of kept: under FSDP it is the gathered weight, freed after forward.
        ctx.save_for_backward(x_q, x_s, w_NK)
        return scaled_mm(x_q, x_s, w_q.t(), w_s, x_MK.dtype, recipe.fast_accum_output)

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        recipe: Fp8Recipe = ctx.recipe
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_MN = grad_MN.contiguous()
        grad_x = grad_w = None
        pow2, gdt = recipe.pow2_scales, recipe.grad_dtype
        if recipe.rowwise:
            x_MK, w_NK = ctx.saved_tensors
            if need_x:
                g_q, g_s = quantize(grad_MN, gdt, -1, pow2)
                w_q, w_s = quantize(w_NK, E4M3, 0, pow2)
                grad_x = scaled_mm(g_q, g_s, w_q, w_s, grad_MN.dtype)
            if need_w:
                # The weight gradient contracts over tokens: both operands get one scale per column.
                gp_q, gp_s = quantize(_pad_rows(grad_MN), gdt, 0, pow2)
                xp_q, xp_s = quantize(_pad_rows(x_MK), E4M3, 0, pow2)
                grad_w = scaled_mm(gp_q.t(), gp_s.t(), xp_q, xp_s, w_NK.dtype)
            return grad_x, grad_w, None
        x_q, x_s, w_NK = ctx.saved_tensors
        g_q, g_s = quantize(grad_MN, gdt)
        if need_x:
            w_q, w_s = quantize(w_NK, E4M3)
            grad_x = scaled_mm(g_q, g_s, w_q, w_s, grad_MN.dtype)
        if need_w:
            grad_w = scaled_mm(_pad_rows(g_q).t(), g_s, _pad_rows(x_q), x_s, w_NK.dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe) -> torch.Tensor:
    """`F.linear` with FP8 GEMMs; any leading dims on `x`."""
    out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Float8Linear(nn.Linear):
    """`nn.Linear` whose matmuls run in FP8; same parameters (names, dtype, storage) as the module it replaces."""

    recipe: Fp8Recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe) -> Float8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = recipe
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.name}"


# --- MoE grouped GEMMs ----------------------------------------------------------------------------------------------


@functools.cache
def _cuda_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_grouped_mm_supported(device: torch.device) -> bool:
    """`torch._scaled_grouped_mm` runs on Hopper-class GPUs (sm90+) only."""
    if FORCE_EMULATION or device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return _cuda_capability(device.index) >= (9, 0)


@dataclass
class _GroupLayout:
    """Each expert's rows copied into a zero buffer at offsets rounded up to multiples of 16 (the kernel's need)."""

    dest_A: torch.Tensor  # row of the padded buffer that each input row goes to
    group_P: torch.Tensor  # expert of every padded row (E for the unused tail)
    lengths_G: torch.Tensor  # padded rows per expert, plus the unused tail (E + 1 entries)
    offs_E: torch.Tensor  # int32 end offsets of the padded groups
    num_rows: int  # P


def _group_layout(counts_E: torch.Tensor, num_rows: int) -> _GroupLayout:
    # Sized from shapes only (no host sync): P = rows + 15 per expert at most, rounded up to 16.
    num_experts = counts_E.shape[0]
    padded_rows = -(-(num_rows + (ALIGN - 1) * num_experts) // ALIGN) * ALIGN
    counts = counts_E.to(torch.int64)
    padded_E = (counts + ALIGN - 1) // ALIGN * ALIGN
    padded_end = padded_E.cumsum(0)
    group_A = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts, output_size=num_rows)
    start_A = (counts.cumsum(0) - counts)[group_A]
    dest_A = (padded_end - padded_E)[group_A] + torch.arange(num_rows, device=counts.device) - start_A
    lengths_G = torch.cat([padded_E, (padded_rows - padded_end[-1:])])
    group_P = torch.repeat_interleave(
        torch.arange(num_experts + 1, device=counts.device), lengths_G, output_size=padded_rows
    )
    return _GroupLayout(dest_A, group_P, lengths_G, padded_end.to(torch.int32), padded_rows)


def _scatter_rows(x_AK: torch.Tensor, layout: _GroupLayout) -> torch.Tensor:
    return x_AK.new_zeros(layout.num_rows, x_AK.shape[1]).index_copy_(0, layout.dest_A, x_AK)


def _quantize_per_group_columns(x_PK: torch.Tensor, layout: _GroupLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 quantization for a GEMM contracting over rows: one scale per (expert group, column) -> [E, K]."""
    amax_GK = torch.segment_reduce(x_PK.abs().float(), "max", lengths=layout.lengths_G, axis=0, initial=0.0)
    scale_GK = amax_to_scale(amax_GK, E4M3, pow2=True)
    fp8_max = torch.finfo(E4M3).max
    x_q = (x_PK.float() * scale_GK[layout.group_P]).clamp(-fp8_max, fp8_max).to(E4M3)
    return x_q, scale_GK[:-1]


def _grouped_mm_emulated(a, a_scale, b, b_scale, offs_E: torch.Tensor) -> torch.Tensor:
    """Reference for `torch._scaled_grouped_mm` (inverse scales as the kernel takes them), fp32 math per group."""
    ends = offs_E.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # [P, K] x [E, K, N] -> [P, N]; rows past the last group stay zero
        out = a.new_zeros(a.shape[0], b.shape[-1], dtype=torch.float32)
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            out[s:t] = (a[s:t].float() * a_scale[s:t, None]) @ (b[e].float() * b_scale[e][None, :])
        return out.to(torch.bfloat16)
    # [K, P] x [P, N] -> [E, K, N], contracting over each group's rows
    num_groups = len(ends)
    a_s, b_s = a_scale.view(num_groups, -1), b_scale.view(num_groups, -1)
    out = [(a[:, s:t].float() * a_s[e][:, None]) @ (b[s:t].float() * b_s[e][None, :]) for e, (s, t) in
           enumerate(zip(starts, ends, strict=True))]  # fmt: skip
    return torch.stack(out).to(torch.bfloat16)


def _grouped(a, a_scale, b, b_scale, offs_E: torch.Tensor) -> torch.Tensor:
    """`torch._scaled_grouped_mm` (a row-major, b column-major, inverse scales) or its emulation."""
    if scaled_grouped_mm_supported(a.device):
        return torch._scaled_grouped_mm(a, b, a_scale, b_scale, offs=offs_E, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)  # fmt: skip
    return _grouped_mm_emulated(a, a_scale, b, b_scale, offs_E)


class _Fp8GroupedMatmul(torch.autograd.Function):
    """Per-expert ``x[rows of e] @ w[e]`` for rows sorted by expert, all GEMMs in FP8 with rowwise scales."""

    @staticmethod
    def forward(ctx, x_AK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        layout = _group_layout(counts_E, x_AK.shape[0])
        x_PK = _scatter_rows(x_AK, layout)
        x_q, x_s = quantize(x_PK, E4M3, -1, True)
        # Scale the weight along K of its [E, N, K] storage: contiguous FP8 whose transpose is the column-major operand.
        w_ENK = w_EKN.transpose(-2, -1)
        w_q, w_s = quantize(w_ENK, E4M3, -1, True)
        out_PN = _grouped(x_q, x_s.reciprocal().view(-1), _col_major(w_q.transpose(-2, -1)),
                          w_s.reciprocal().squeeze(-1), layout.offs_E)  # fmt: skip
        ctx.save_for_backward(x_PK, w_EKN, layout.dest_A, layout.group_P, layout.lengths_G, layout.offs_E)
        ctx.num_rows = layout.num_rows
        return out_PN[layout.dest_A].to(x_AK.dtype)

    @staticmethod
    def backward(ctx, grad_AN: torch.Tensor):
        x_PK, w_EKN, dest_A, group_P, lengths_G, offs_E = ctx.saved_tensors
        layout = _GroupLayout(dest_A, group_P, lengths_G, offs_E, ctx.num_rows)
        grad_PN = _scatter_rows(grad_AN.contiguous(), layout)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # grad_x = grad @ w[e].T: scale grad per row and w per (expert, K) over N.
            g_q, g_s = quantize(grad_PN, E4M3, -1, True)
            w_q, w_s = quantize(w_EKN.contiguous(), E4M3, -1, True)  # [E, K, N], one scale per (e, k)
            b, b_s = _col_major(w_q.transpose(-2, -1)), w_s.reciprocal().squeeze(-1)
            grad_x = _grouped(g_q, g_s.reciprocal().view(-1), b, b_s, offs_E)[dest_A].to(grad_AN.dtype)
        if ctx.needs_input_grad[1]:
            # grad_w[e] = x[e].T @ grad[e] contracts over the group's rows: one scale per (expert, column).
            xc_q, xc_s = _quantize_per_group_columns(x_PK, layout)
            gc_q, gc_s = _quantize_per_group_columns(grad_PN, layout)
            a, b = xc_q.t().contiguous(), _col_major(gc_q)
            grad_w = _grouped(a, xc_s.reciprocal().reshape(-1), b, gc_s.reciprocal().reshape(-1), offs_E)
            grad_w = grad_w.to(w_EKN.dtype)
        return grad_x, grad_w, None


def fp8_grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """FP8 version of `kernels.grouped_mm` (bf16 output cast back to `x`'s dtype)."""
    return _Fp8GroupedMatmul.apply(x_AK, w_EKN, counts_E)


class Float8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose two grouped matmuls run in FP8; same parameters as the module it replaces."""

    @classmethod
    def from_experts(cls, experts: GroupedExperts) -> Float8GroupedExperts:
        new = cls.__new__(cls)
        new.__dict__.update(experts.__dict__)
        return new

    def grouped_mm(self, x_AK, w_EKN, counts_E, offs_E):
        if x_AK.shape[-1] % ALIGN or w_EKN.shape[-1] % ALIGN:
            return super().grouped_mm(x_AK, w_EKN, counts_E, offs_E)
        return fp8_grouped_mm(x_AK, w_EKN, counts_E)
