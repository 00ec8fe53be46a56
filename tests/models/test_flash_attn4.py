"""FlashAttention-4 (`flash-attn-4`) as the ``flash_attn4`` attention backend.

FA4's kernels need a Hopper or Blackwell GPU, so on CPU a stand-in of its interface module (each sample's causal
attention with SDPA, the same call signature and return values) serves the op; the kernel itself is checked against
SDPA on a GPU (`gpu` marker)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prime_models import apply_activation_checkpointing, kernels, load_model
from prime_models.layers import flash_attn4
from prime_models.layers.attention import row_packing, use_row_packing
from prime_models.loading import resolve_attn
from prime_models.parallel import compile as compile_module
from prime_models.parallel.activation_checkpoint import ATTENTION_OPS

from tests.models.conftest import VOCAB, gpu_attention_config, rows_of_short_samples, tiny_config

QWEN3_06B = Path(__file__).resolve().parents[2] / "benchmarks/models/qwen3-0.6b"  # its config: the trainer's checks
LENGTHS = [5, 9, 2, 7]  # one row of four samples, and a second row of one
SEQ = sum(LENGTHS)


def _per_sample(q, k, v, cu, scale):
    out = torch.empty_like(q)
    for start, end in zip(cu.tolist()[:-1], cu.tolist()[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out


class _StandInInterface(types.ModuleType):
    """`flash_attn.cute.interface`'s `_flash_attn_fwd` / `_flash_attn_bwd` on CPU; counts the calls of each."""

    def __init__(self):
        super().__init__("flash_attn.cute.interface")
        self.forwards = self.backwards = 0

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, return_lse):  # fmt: skip
        assert causal and return_lse and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        assert cu_seqlens_q.dtype == torch.int32 and k.shape[1] < q.shape[1]  # GQA goes in unexpanded
        q.data_ptr()  # as FA4 does (an alignment check), which a traced tensor cannot answer
        self.forwards += 1
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return _per_sample(q, k, v, cu_seqlens_q, softmax_scale), lse, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, *, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k):  # fmt: skip
        assert causal and dout.is_contiguous() and lse.shape == (q.shape[1], q.shape[0])
        dout.data_ptr()
        self.backwards += 1

        def grads():
            qkv = [t.detach().requires_grad_() for t in (q, k, v)]
            again = _per_sample(*qkv, cu_seqlens_q, softmax_scale)
            return torch.autograd.grad(again, qkv, dout)

        # Called inside the backward op, where autograd is off for this thread; a thread of its own has it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(grads).result()


@pytest.fixture
def stand_in(monkeypatch) -> _StandInInterface:
    fake = _StandInInterface()
    monkeypatch.setattr(flash_attn4, "interface", lambda: fake)
    return fake


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(n) for n in LENGTHS]), torch.arange(SEQ)])
    return ids, positions


def _step(model, ids, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with use_row_packing(row_packing(positions[:, :-1])):
        lp, _ = model(ids[:, :-1], positions[:, :-1], targets=ids[:, 1:])
    lp.sum().backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _model(backend: str, ac: str = "none"):
    model = load_model(tiny_config("qwen3"), seed=0)
    model.attn_backend = backend  # resolve_attn refuses flash_attn4 off a GPU; the stand-in serves it here
    if ac != "none":
        apply_activation_checkpointing(model.model.layers, "full", keep_attention=-1 if ac == "keep" else 0)
    return model


def test_flash_attn4_trains_like_sdpas_mask(stand_in):
    ids, positions = _rows()
    lp_fa4, grads_fa4 = _step(_model("flash_attn4"), ids, positions)
    lp_sdpa, grads_sdpa = _step(_model("sdpa"), ids, positions)
    layers = 2
    assert (stand_in.forwards, stand_in.backwards) == (layers, layers)
    torch.testing.assert_close(lp_fa4, lp_sdpa, atol=1e-5, rtol=1e-5)
    assert grads_fa4.keys() == grads_sdpa.keys()
    for name, grad in grads_sdpa.items():
        torch.testing.assert_close(grads_fa4[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("ac", "forwards"), [("full", 4), ("keep", 2)])
def test_kept_attention_keeps_flash_attn4s_output_instead_of_running_it_again(stand_in, ac, forwards):
    ids, positions = _rows()
    lp, grads = _step(_model("flash_attn4", ac), ids, positions)
    assert torch.ops.prime_models.flash_attn4_varlen.default in ATTENTION_OPS
    assert (stand_in.forwards, stand_in.backwards) == (forwards, 2)  # 2 layers; full AC runs each forward again
    lp_plain, grads_plain = _step(_model("sdpa"), ids, positions)
    torch.testing.assert_close(lp, lp_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["model.layers.0.self_attn.q_proj.weight"],
                               grads_plain["model.layers.0.self_attn.q_proj.weight"], atol=1e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("ac", ["none", "keep"])
def test_compiled_layers_call_flash_attn4s_backward_as_a_kernel(stand_in, monkeypatch, ac):
    """`parallel.compile_layers` with FA4: the compiled backward calls the kernel instead of tracing into FA4's
    Python (on a GPU it failed at the first backward: FA4 reads data pointers, which traced tensors have not)."""
    monkeypatch.setattr(compile_module, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    ids, positions = _rows()
    model = _model("flash_attn4")
    compile_module.compile_layers(model.model.layers)
    if ac == "keep":
        apply_activation_checkpointing(model.model.layers, "full", keep_attention=-1)
    lp, grads = _step(model, ids, positions)
    torch._dynamo.reset()
    assert stand_in.backwards == 2
    lp_eager, grads_eager = _step(_model("flash_attn4", ac), ids, positions)
    torch.testing.assert_close(lp, lp_eager, atol=1e-5, rtol=1e-5)
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_long_rows_take_the_long_row_backward_tiles_for_that_call_only():
    @dataclasses.dataclass(frozen=True)
    class Config:
        m_block_size: int = 64
        dQ_swapAB: bool = False

    fa4 = types.SimpleNamespace(_tile_size_bwd_sm90=lambda *args, **kwargs: Config())
    own = fa4._tile_size_bwd_sm90
    with flash_attn4.long_row_backward(fa4, flash_attn4.LONG_ROW_TOKENS - 1):
        assert fa4._tile_size_bwd_sm90(128, 128, True, False) == Config()
    with flash_attn4.long_row_backward(fa4, flash_attn4.LONG_ROW_TOKENS):
        assert fa4._tile_size_bwd_sm90(128, 128, True, False) == Config(80, True)
        assert fa4._tile_size_bwd_sm90(64, 64, True, False) == Config()  # other shapes keep FA4's tiles
    assert fa4._tile_size_bwd_sm90 is own
    with flash_attn4.long_row_backward(types.SimpleNamespace(), flash_attn4.LONG_ROW_TOKENS):
        pass  # an FA4 without the table: nothing to change


def _package(root, *, fa2: bool, fa4: bool) -> None:
    pkg = root / "flash_attn"
    (pkg / "cute").mkdir(parents=True)
    if fa2:
        (pkg / "__init__.py").write_text("")
    if fa4:
        (pkg / "cute" / "interface.py").write_text("")


@pytest.mark.parametrize(("fa2", "fa4"), [(False, True), (True, False), (True, True)])
def test_flash_attn_4_alone_is_not_taken_for_flash_attn_2(tmp_path, monkeypatch, fa2, fa4):
    _package(tmp_path, fa2=fa2, fa4=fa4)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert kernels._flash_attn_installed() == (fa2, fa4)


def test_flash_attn4_without_the_package_or_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN4", False)
    with pytest.raises(ValueError, match=r"^attn='flash_attn4' needs a package that is not installed: pip install "
                       r"flash-attn-4 \(FlashAttention-4: Hopper and Blackwell GPUs\)$"):  # fmt: skip
        resolve_attn("flash_attn4", torch.device("cpu"))
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN4", True)
    with pytest.raises(ValueError, match=r"^attn='flash_attn4' needs a CUDA device, got cpu$"):
        resolve_attn("flash_attn4", torch.device("cpu"))
    assert resolve_attn("auto", torch.device("cpu")) == "sdpa"


@pytest.mark.parametrize("fa2", [False, True])
def test_auto_on_a_cpu_is_sdpa_without_an_install_hint(monkeypatch, caplog, fa2):
    """A CPU run's `attn = auto` warned "flash-attn not installed, falling back to SDPA (pip install ...)": a package
    a CPU cannot use."""
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN", fa2)
    with caplog.at_level("INFO", logger="prime_models.loading"):
        assert resolve_attn("auto", torch.device("cpu")) == "sdpa"
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


@pytest.mark.parametrize(
    ("fa2", "fa4", "capability", "row_len", "chosen"),
    [
        (False, True, (9, 0), 65536, "flash_attn4"),  # long rows on Hopper: FA4 measured 8-9% faster at 64k
        (True, True, (10, 0), 32768, "flash_attn4"),
        (True, True, (9, 0), 16384, "flash_attn"),  # even at 16k, slower for short rows: not picked
        (False, True, (9, 0), 2048, "sdpa"),
        (False, True, (9, 0), None, "sdpa"),  # row length unknown (inference): never
        (False, True, (8, 0), 65536, "sdpa"),  # Ampere: FA4 has no kernels for it
        (False, False, (9, 0), 65536, "sdpa"),
    ],
)
def test_auto_picks_flash_attn4_for_long_rows_on_hopper_where_installed(monkeypatch, fa2, fa4, capability, row_len,
                                                                        chosen):  # fmt: skip
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN", fa2)
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN4", fa4)
    monkeypatch.setattr(flash_attn4, "interface", lambda: types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_attn("auto", torch.device("cuda", 0), row_len=row_len) == chosen
    assert resolve_attn("auto", torch.device("cpu"), row_len=row_len) == "sdpa"


def test_an_installed_flash_attn4_that_does_not_import_is_a_warning_under_auto_and_one_line_when_asked(
    monkeypatch, caplog
):
    """flash-attn-4 found on disk whose import fails (its CuTe-DSL runtime, a separate wheel, missing): `auto` would
    have picked it for long rows and the run failed at its first forward with a traceback."""

    def broken():
        raise ModuleNotFoundError("No module named 'cutlass'\n(more lines)")

    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN", False)
    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN4", True)
    monkeypatch.setattr(flash_attn4, "interface", broken)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with caplog.at_level("WARNING", logger="prime_models.loading"):
        assert resolve_attn("auto", torch.device("cuda", 0), row_len=65536) == "sdpa"
    assert "flash-attn-4 is installed but does not import (ModuleNotFoundError: No module named 'cutlass'); not" in (
        caplog.text
    )
    with pytest.raises(ValueError, match=r"^attn='flash_attn4': flash-attn-4 is installed but does not import "
                       r"\(ModuleNotFoundError: No module named 'cutlass'\)$"):  # fmt: skip
        resolve_attn("flash_attn4", torch.device("cuda", 0))


def test_the_trainer_names_init_attn_in_one_line(monkeypatch):
    from prime_core.config import ConfigError
    from prime_core.config.parallel import ParallelConfig
    from prime_core.config.trainer import ModelInitConfig
    from prime_trainer.model import build_model
    from prime_trainer.world import World

    monkeypatch.setattr(kernels, "HAS_FLASH_ATTN4", False)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    init = ModelInitConfig(random=True, attn="flash_attn4")
    with pytest.raises(ConfigError, match=r"^init.attn: attn='flash_attn4' needs a package that is not installed: "):
        build_model(str(QWEN3_06B), "auto", init, ParallelConfig(), world, seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_FLASH_ATTN4), reason="needs a GPU and flash-attn-4")
@pytest.mark.parametrize("ac", ["none", "keep_attention", "offload_attention"])
def test_gpu_flash_attn4_trains_like_sdpa(ac):
    """bf16 Qwen3-shaped layers (GQA 16/8 heads of 128), rows of many short samples: FA4's log-probs and gradients
    against SDPA (torch's varlen kernel) on the same rows, with and without checkpointing that keeps its outputs."""
    cfg = gpu_attention_config()
    device = torch.device("cuda")
    ids, positions = rows_of_short_samples()
    results = {}
    for attn in ("flash_attn4", "sdpa"):
        model = load_model(cfg, dtype=torch.bfloat16, device=device, seed=0, attn=attn)
        assert model.attn_backend == attn
        if ac != "none":
            apply_activation_checkpointing(
                model.model.layers, "full", keep_attention=-1, offload_attention=ac == "offload_attention"
            )
        with use_row_packing(row_packing(positions[:, :-1], device)):
            lp, _ = model(ids[:, :-1].to(device), positions[:, :-1].to(device), targets=ids[:, 1:].to(device))
            lp.float().mean().backward()
        results[attn] = lp.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}
    (lp_f, g_f), (lp_s, g_s) = results["flash_attn4"], results["sdpa"]
    assert (lp_f - lp_s).abs().max().item() < 0.05
    for n, grad in g_s.items():
        rel = (g_f[n] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert rel.item() < 0.02, (n, rel.item())


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.HAS_FLASH_ATTN4), reason="needs a GPU and flash-attn-4")
def test_gpu_long_row_backward_tiles_give_fa4s_own_gradients(monkeypatch):
    """The long-row backward tiles (80x128) against FA4's own (64x128) on samples of lengths no tile size divides."""
    lengths, heads, kv_heads, dim = [4097, 77, 3000, 1], 16, 8, 128
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qo")
    k, v = (torch.randn(sum(lengths), kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
    args = (cu, max(lengths), dim**-0.5)
    out, lse = flash_attn4.flash_attn4_varlen(q, k, v, *args)
    own = flash_attn4.flash_attn4_varlen_backward(q, k, v, out, dout, lse, *args)
    monkeypatch.setattr(flash_attn4, "LONG_ROW_TOKENS", 1)
    long_row = flash_attn4.flash_attn4_varlen_backward(q, k, v, out, dout, lse, *args)
    for a, b in zip(long_row, own, strict=True):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 1e-2
