"""Host offload of the kept attention outputs under full activation checkpointing: bitwise the same training step."""

from __future__ import annotations

import time

import pytest
import torch
from prime_core.config.trainer import ParallelConfig
from prime_models import apply_activation_checkpointing, load_model
from prime_models.parallel.activation_checkpoint import layer_checkpoint
from prime_models.parallel.attention_offload import AttentionOffload
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models.conftest import VOCAB, tiny_config

BATCH, SEQ = 2, 17
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _packed_positions() -> torch.Tensor:
    # Two samples per row (7 + 9 tokens): the masked SDPA path.
    return torch.cat([torch.arange(7), torch.arange(SEQ - 1 - 7)]).expand(BATCH, -1)


class _CountAttention(TorchDispatchMode):
    """Counts attention kernel runs (forward and recompute: backward runs on this thread on CPU)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is CPU_ATTENTION
        return func(*args, **(kwargs or {}))


def _step(model, ids, positions=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logprobs, _ = model(ids[:, :-1], positions, targets=ids[:, 1:])
    loss = -logprobs.mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _offload_of(model) -> AttentionOffload:
    return next(layer_checkpoint(layer).offload for layer in model.model.layers if layer_checkpoint(layer).offload)


def _pooled(offload: AttentionOffload) -> list[torch.Tensor]:
    return [buf for bufs in offload._pool.values() for buf in bufs]


@pytest.mark.parametrize(
    "model_type,keep_attention,mlp_chunks,packed",
    [("qwen3", -1, 0, False), ("qwen3", 1, 0, False), ("qwen3", -1, 3, False), ("qwen3", 2, 0, True),
     ("qwen3_moe", -1, 0, False)],
)  # fmt: skip
def test_offload_is_bitwise_identical(model_type, keep_attention, mlp_chunks, packed):
    cfg = tiny_config(model_type, num_hidden_layers=3)
    ids, positions = _ids(), _packed_positions() if packed else None
    results, runs = {}, {}
    for offload in (False, True):
        model = load_model(cfg, seed=0)
        apply_activation_checkpointing(
            model.model.layers, "full", keep_attention=keep_attention, mlp_chunks=mlp_chunks, offload_attention=offload
        )
        with _CountAttention() as counter:
            results[offload] = _step(model, ids, positions)
        runs[offload] = counter.runs
    (ref_loss, ref_grads), (loss, grads) = results[False], results[True]
    assert ref_grads.keys() == grads.keys()
    mismatched = [n for n in ref_grads if not torch.equal(ref_grads[n], grads[n])]
    print(f"{model_type} keep_attention={keep_attention} mlp_chunks={mlp_chunks} packed={packed}: loss "
          f"{loss.item():.6f} vs {ref_loss.item():.6f}, {len(mismatched)}/{len(grads)} grads differ, attention "
          f"kernel runs {runs[True]} (offload) / {runs[False]} (kept on device)")  # fmt: skip
    assert torch.equal(loss, ref_loss)
    assert not mismatched
    # The recompute takes the restored outputs: attention runs once per layer plus once per recomputed layer.
    kept = cfg.num_hidden_layers if keep_attention < 0 else keep_attention
    assert runs[True] == runs[False] == 2 * cfg.num_hidden_layers - kept


def test_offload_holds_kept_outputs_on_host_and_reuses_buffers():
    cfg = tiny_config("qwen3", num_hidden_layers=3)
    model = load_model(cfg, seed=0)
    apply_activation_checkpointing(model.model.layers, "full", keep_attention=2, offload_attention=True)
    offload = _offload_of(model)
    assert [layer_checkpoint(layer).offload is offload for layer in model.model.layers] == [False, True, True]
    ids = _ids()
    logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
    # Between forward and backward the two kept layers' output and logsumexp live in host buffers taken from the pool.
    assert _pooled(offload) == []
    (-logprobs.mean()).backward()
    buffers = _pooled(offload)
    assert len(buffers) == 2 * 2
    pointers = sorted(b.data_ptr() for b in buffers)
    shapes = sorted(tuple(b.shape) for b in buffers)
    assert shapes == sorted(2 * [(BATCH, cfg.num_attention_heads, SEQ - 1, cfg.head_dim)]
                            + 2 * [(BATCH, cfg.num_attention_heads, SEQ - 1)])  # fmt: skip
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _step(model, ids)
        assert sorted(b.data_ptr() for b in _pooled(offload)) == pointers


def test_forward_without_backward_returns_buffers():
    model = load_model(tiny_config("qwen3"), seed=0)
    apply_activation_checkpointing(model.model.layers, "full", keep_attention=-1, offload_attention=True)
    offload = _offload_of(model)
    ids = _ids()
    logprobs, entropy = model(ids[:, :-1], targets=ids[:, 1:])
    assert _pooled(offload) == []
    del logprobs, entropy  # frees the graph and with it the saved regions
    assert len(_pooled(offload)) == 2 * 2
    _step(model, ids)  # and the next step reuses them
    assert len(_pooled(offload)) == 2 * 2


def test_second_backward_is_an_error():
    model = load_model(tiny_config("qwen3"), seed=0)
    apply_activation_checkpointing(model.model.layers, "full", keep_attention=-1, offload_attention=True)
    ids = _ids()
    logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
    loss = -logprobs.mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="restored once"):
        loss.backward()


@pytest.mark.parametrize("mode,keep_attention", [("full", 0), ("selective", -1), ("none", 1)])
def test_offload_needs_full_ac_with_kept_attention(mode, keep_attention):
    model = load_model(tiny_config("qwen3"), seed=0)
    with pytest.raises(ValueError, match="offload_attention needs mode 'full' and keep_attention != 0"):
        apply_activation_checkpointing(model.model.layers, mode, keep_attention=keep_attention, offload_attention=True)


@pytest.mark.parametrize("ac,keep_attention", [("full", 0), ("selective", 0), ("none", 0)])
def test_config_rejects_offload_without_kept_attention(ac, keep_attention):
    with pytest.raises(ValidationError) as info:
        ParallelConfig(ac=ac, ac_keep_attention=keep_attention, ac_offload_attention=True)
    message = str(info.value)
    assert "ac_offload_attention needs ac = 'full' and ac_keep_attention != 0" in message
    assert f"ac = {ac!r}, ac_keep_attention = {keep_attention}" in message
    config = ParallelConfig(ac="full", ac_keep_attention=-1, ac_offload_attention=True)
    assert config.ac_offload_attention


def _gpu_step_stats(model, ids, steps: int = 3) -> tuple[float, float, torch.Tensor, dict[str, torch.Tensor]]:
    _step(model, ids)  # warm-up: compiles the elementwise kernels, fills the host buffer pool
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(steps):
        loss, grads = _step(model, ids)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return (torch.cuda.max_memory_allocated() - base) / 2**20, seconds, loss, grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_offload_lowers_peak_with_the_same_step():
    """bf16, Qwen3-0.6B's layer shape, 8 layers of one 64k row, every layer keeping attention: the kept outputs (260
    MiB per layer) leave the GPU, and the step is bitwise the same as far as the kernels are deterministic."""
    seq, layers = 65536, 8
    cfg = tiny_config("qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=layers, max_position_embeddings=seq + 1)  # fmt: skip
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(0)).cuda()
    stats = {}
    for name, offload in (("kept", False), ("kept again", False), ("offloaded", True)):
        model = load_model(cfg, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
        apply_activation_checkpointing(
            model.model.layers, "full", keep_attention=-1, mlp_chunks=4, offload_attention=offload
        )
        stats[name] = _gpu_step_stats(model, ids)
        del model
        torch.cuda.empty_cache()

    def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

    (peak, seconds, loss, grads), (_, _, _, grads_again) = stats["kept"], stats["kept again"]
    off_peak, off_seconds, off_loss, off_grads = stats["offloaded"]
    noise, diff = max_diff(grads, grads_again), max_diff(grads, off_grads)
    per_layer = seq * 16 * (128 * 2 + 4) / 2**20
    print(f"peak over the step: {peak:.0f} MiB kept -> {off_peak:.0f} MiB offloaded (kept outputs {per_layer:.0f} MiB "
          f"x {layers} layers); step {seconds * 1e3:.0f} ms -> {off_seconds * 1e3:.0f} ms ({seq / seconds:.0f} -> "
          f"{seq / off_seconds:.0f} tok/s); loss {loss.item()} vs {off_loss.item()}; max grad diff {diff:.1e} "
          f"(run-to-run without offload {noise:.1e})")  # fmt: skip
    assert torch.equal(loss, off_loss)
    assert diff <= 2 * noise  # 0 when the attention backward is deterministic
    # At most two layers' outputs are on the GPU at once (the one in backward and the prefetched one).
    assert peak - off_peak > 0.5 * (layers - 2) * per_layer
