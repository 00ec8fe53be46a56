"""Optional kernels, each with a pure-PyTorch fallback and a flag.

`HAS_FLASH_ATTN` is True when the `flash-attn` extra (FlashAttention-2) is importable, `HAS_FLASH_ATTN4` when the
`flash-attn-4` distribution (`flash_attn.cute`) is; `HAS_GROUPED_MM` when this torch build ships
`torch._grouped_mm`. Tests may flip `FORCE_GROUPED_MM_FALLBACK` to exercise the fallback path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

import torch


def _flash_attn_installed() -> tuple[bool, bool]:
    """(FlashAttention-2, FlashAttention-4) without importing either: flash-attn-4 alone installs `flash_attn` as a
    namespace package holding only `cute`, so `flash_attn` being found says nothing about FlashAttention-2."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return False, False
    dirs = [Path(d) for d in spec.submodule_search_locations or ()]
    fa2 = spec.origin is not None and spec.origin.endswith("__init__.py")
    return fa2, any((d / "cute" / "interface.py").is_file() for d in dirs)


HAS_FLASH_ATTN, HAS_FLASH_ATTN4 = _flash_attn_installed()
HAS_GROUPED_MM: bool = hasattr(torch, "_grouped_mm")
FORCE_GROUPED_MM_FALLBACK: bool = False

FLASH_ATTN_INSTALL_HINT = "pip install prime-models[flash-attn]"
# Not an extra: flash-attn-4 is on PyPI but not on every index a lock file is made against.
FLASH_ATTN4_INSTALL_HINT = "pip install flash-attn-4 (FlashAttention-4: Hopper and Blackwell GPUs)"

# SDPA backend priority on CUDA, e.g. "cudnn,flash,efficient" (names of `torch.nn.attention.SDPBackend` members, lower
# case). Empty keeps torch's own order. Read once from PRIME_SDPA_BACKENDS; benchmarks and tests may set it directly.
SDPA_BACKENDS: tuple[str, ...] = tuple(b for b in os.environ.get("PRIME_SDPA_BACKENDS", "").split(",") if b)
# Unmasked (one sample per row) SDPA on CUDA runs with `enable_gqa=True` instead of expanding K/V to every query head:
# the same cuDNN kernel without the expanded copies (+4% at 16k, -0.25 GiB at 64k on an H100). PRIME_SDPA_GQA=0 brings
# back the expansion, which keeps every SDPA backend eligible for comparisons.
SDPA_NATIVE_GQA: bool = os.environ.get("PRIME_SDPA_GQA", "1") != "0"
_SDPA_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_backend_context(device: torch.device):
    """Context manager that applies `SDPA_BACKENDS` (as a priority order) on CUDA; a no-op otherwise."""
    if not SDPA_BACKENDS or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, _SDPA_NAMES[b]) for b in SDPA_BACKENDS]
    # Keep every other backend as a fallback so unsupported shapes still run.
    order += [getattr(SDPBackend, n) for n in _SDPA_NAMES.values() if getattr(SDPBackend, n) not in order]
    return sdpa_kernel(order, set_priority=True)


# Elementwise chains (RMSNorm, rotary, SwiGLU gating) on CUDA tensors go through `torch.compile`, which fuses each
# into one or two kernels instead of a dozen bf16/fp32 passes. CPU always runs the eager function (tests, parity).
COMPILE_ON_CUDA: bool = os.environ.get("PRIME_COMPILE_ELEMENTWISE", "1") != "0"


def cuda_compiled(fn):
    """Decorator: call `torch.compile(fn)` when the first argument is a CUDA tensor (and `COMPILE_ON_CUDA`), else `fn`."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        # Inside a compiled layer (`prime_models.parallel.compile`) the eager function is traced into its graph.
        if COMPILE_ON_CUDA and args[0].is_cuda and not torch.compiler.is_compiling():
            if compiled is None:
                compiled = torch.compile(fn, dynamic=False)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


ADDMM_FP32_OUT: bool = True
"""Whether this torch's CUDA ``addmm`` takes ``out_dtype=float32`` for low-precision inputs (turned off at the first
failure)."""


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` and low-precision ``a``, ``b``, summed in fp32 without rounding the product
    to the inputs' dtype: on CUDA one cuBLAS call accumulating in place (``addmm(..., out_dtype=float32)``), no
    temporary; elsewhere the product of the inputs cast to fp32 (the same numbers, two temporaries)."""
    global ADDMM_FP32_OUT
    if a.dtype != torch.float32 and a.is_cuda and ADDMM_FP32_OUT:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, NotImplementedError, TypeError):
            ADDMM_FP32_OUT = False
    acc.addmm_(a.float(), b.float())


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s CUDA stream is recording a CUDA graph (`prime_models.parallel.cuda_graphs`); False off CUDA.

    Code that stashes the CUDA RNG state (activation checkpointing, chunked MLPs) skips it then: reading the
    generator's seed is illegal during a capture."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# Packed rows (several samples a row) under SDPA on CUDA attend through torch's own variable-length flash kernel
# (`torch.nn.attention.varlen`, FA2 built into torch, forward and backward) instead of a block-diagonal mask: no mask,
# and no attention across the masked-out blocks, which a dense mask's kernel computes anyway (the one-GPU loop's rows
# hold ~10 samples of ~200 tokens: a tenth of a row's causal FLOPs). PRIME_SDPA_VARLEN=0 brings back the mask.
SDPA_VARLEN: bool = os.environ.get("PRIME_SDPA_VARLEN", "1") != "0"


@functools.cache
def torch_varlen_attn():
    """torch's `varlen_attn` (registers the ``torch_attn::_varlen_attn`` op), or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_attention_ops() -> frozenset:
    """The op `torch_varlen_attn` runs (for activation checkpointing's kept-attention policy), if this torch has it."""
    if torch_varlen_attn() is None:
        return frozenset()
    try:
        return frozenset({torch.ops.torch_attn._varlen_attn.default})
    except (AttributeError, RuntimeError):
        return frozenset()


def flash_attn_varlen_func():
    """Return flash-attn's varlen kernel, importing it only when the flash path is actually used."""
    if not HAS_FLASH_ATTN:
        raise ValueError(f"attn='flash_attn' needs the flash-attn extra: {FLASH_ATTN_INSTALL_HINT}")
    from flash_attn import flash_attn_varlen_func as fn

    return fn


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    # Support depends on the device (CUDA needs sm90+ in some builds) and dtype, so probe once instead of guessing.
    if not HAS_GROUPED_MM:
        return False
    try:
        a = torch.zeros(8, 16, device=device_type, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device_type, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([4, 8], device=device_type, dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can run `x @ w[e]` per group for these operands."""
    if FORCE_GROUPED_MM_FALLBACK or x.dtype != w.dtype:
        return False
    # The kernel requires 16-byte aligned row strides for both operands.
    elem = x.element_size()
    if (x.shape[-1] * elem) % 16 or (w.shape[-1] * elem) % 16 or (w.shape[-2] * elem) % 16:
        return False
    return _grouped_mm_works(x.device.type, x.dtype)


def grouped_mm(x_TK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Per-expert matmul over rows sorted by expert: rows `offs[e-1]:offs[e]` of `x` are multiplied by `w[e]`.

    `w` may be a transposed view (e.g. `[E, N, K].transpose(-2, -1)`). Uses `torch._grouped_mm` when it runs on this
    device/dtype, else loops over the experts that actually received tokens.
    """
    if grouped_mm_available(x_TK, w_EKN):
        return torch._grouped_mm(x_TK, w_EKN, offs=offs_E)
    # One host sync for the split sizes; empty experts are skipped so the loop runs over active experts only.
    sizes = counts_E.tolist()
    pieces = [torch.mm(seg, w_EKN[e]) for e, seg in enumerate(torch.split(x_TK, sizes)) if sizes[e]]
    return torch.cat(pieces) if pieces else x_TK.new_zeros(0, w_EKN.shape[-1])
