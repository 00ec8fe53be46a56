"""``parallel.ac = "auto"``: the activation checkpointing plan chosen from a micro-batch's size and the free memory
(pure function, facts passed in), its estimates against the H100 peaks they were fit to, and the trainer's use of it."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from prime_core.config import load_config
from prime_core.config.trainer import TrainerConfig
from prime_models import load_model
from prime_trainer import memory as M
from prime_trainer.world import World

from tests.trainer.trainer_utils import TINY_QWEN3

GIB = M.GIB
# Qwen3-0.6B (the benchmarks' shape) and what one GPU holds besides activations on the one-rank path: fp32 masters,
# the bf16 working copy, AdamW's moments, bf16 gradients during the backward.
QWEN3_06B = M.ModelShape(
    hidden=1024, layers=28, mlp_width=3072, attn_width=2048, heads=16, vocab=151936,
    layer_params=6 * 1024 * 1024 + 3 * 1024 * 3072,
)  # fmt: skip
NUM_PARAMS = 596_049_920
ONE_RANK_STATE = NUM_PARAMS * (4 + 2) + M.training_state_bytes(NUM_PARAMS, 4, False, 2)
HOST = 200 * GIB


def plan(tokens: int, row_len: int, free_gib: float, host: int = HOST, packed_rows: int = 0) -> M.MemoryPlan:
    budget = M.activation_budget(int(free_gib * GIB), ONE_RANK_STATE)
    return M.choose_plan(QWEN3_06B, tokens, row_len, budget, host, packed_rows=packed_rows)


def knobs(p: M.MemoryPlan) -> tuple:
    return p.ac, p.keep_attention, p.offload_attention, p.mlp_chunks


def test_a_64k_row_gets_the_best_measured_flags_and_stays_under_16_gib():
    # The 64k row's best flags on an H100 (docs/benchmarks.md): keep every attention output, offloaded to host memory.
    # Long rows hide the copies (ratio 0.2), so this is chosen even where everything would fit on the GPU.
    whole_gpu = plan(65536, 65536, free_gib=79)
    assert knobs(whole_gpu) == ("full", -1, True, 0)
    assert whole_gpu.host_bytes == 65536 * 28 * (2 * 2048 + 4 * 16)
    assert ONE_RANK_STATE + whole_gpu.activation_bytes < 16 * GIB
    assert M.offload_copy_ratio(QWEN3_06B, 65536) < 0.5
    # Without the host memory for it, the outputs stay on the GPU when they fit, else as many as fit.
    assert knobs(plan(65536, 65536, free_gib=79, host=4 * GIB)) == ("full", -1, False, 0)
    partial = plan(65536, 65536, free_gib=20, host=4 * GIB)
    assert partial.ac == "full" and 0 < partial.keep_attention < 28 and not partial.offload_attention
    assert partial.fits


def test_a_16k_row_keeps_everything_when_it_can_and_offloads_under_a_12_5_gib_cap():
    assert knobs(plan(16384, 16384, free_gib=79)) == ("none", 0, False, 0)
    capped = plan(16384, 16384, free_gib=12.5)
    # At 16k the copies take about half a layer's forward: worth it only where the GPU cannot keep the outputs.
    assert 0.5 < M.offload_copy_ratio(QWEN3_06B, 16384) <= 1.0
    assert knobs(capped) == ("full", -1, True, 0) and capped.fits
    assert knobs(plan(16384, 16384, free_gib=16)) == ("full", -1, False, 0)


def test_short_rows_never_offload_and_the_last_resort_says_it_may_not_fit():
    # The loop's 2048-token rows, 8 a forward: the copies would outlast the layer's compute.
    assert M.offload_copy_ratio(QWEN3_06B, 2048) > 1.0
    eight = plan(8 * 2048, 2048, free_gib=20, packed_rows=8)
    assert eight.ac == "full" and not eight.offload_attention
    tight = plan(16384, 16384, free_gib=10)
    assert knobs(tight) == ("full", 0, False, M.LAST_RESORT_MLP_CHUNKS) and not tight.fits
    assert "may not fit" in tight.describe()


def test_more_memory_never_means_more_recompute():
    # Order of the ladder by recompute: none < keep all (wherever) < keep some < full < full + chunks.
    def rank(p: M.MemoryPlan) -> tuple:
        return (p.ac == "full", p.keep_attention == 0, -p.keep_attention % 1000, p.mlp_chunks)

    for tokens, row_len in [(65536, 65536), (16384, 16384), (16384, 2048)]:
        ranks = [rank(plan(tokens, row_len, free_gib=g / 2)) for g in range(16, 200)]
        assert ranks == sorted(ranks, reverse=True), (tokens, row_len)


@pytest.mark.parametrize(
    "tokens,row_len,packed,knob,measured_gib",
    [
        # H100 peaks under FSDP2 on one rank (benchmarks/results/trainer_gpu_*.json), same shape.
        (16384, 16384, 0, dict(ac="full"), 10.34),
        (65536, 65536, 0, dict(ac="full"), 14.38),
        (16384, 16384, 0, dict(ac="full", keep_attention=-1), 12.12),
        (65536, 65536, 0, dict(ac="full", keep_attention=-1), 21.24),
        (65536, 65536, 0, dict(ac="full", keep_attention=-1, offload_attention=True), 14.64),
        (65536, 65536, 0, dict(ac="full", mlp_chunks=8), 14.03),
        (2048, 2048, 1, dict(ac="none"), 13.88),
        (8 * 2048, 2048, 8, dict(ac="none"), 34.51),
        (16384, 16384, 1, dict(ac="none"), 46.76),
        (16384, 16384, 1, dict(ac="full"), 12.82),
    ],
)
def test_estimates_with_their_margin_cover_the_measured_fsdp_peaks(tokens, row_len, packed, knob, measured_gib):
    # FSDP2 on one rank holds fp32 parameters, moments and gradients, plus the root's and two layers' bf16 copies.
    fsdp_state = NUM_PARAMS * 16 + 2 * (2 * 15_730_688 + 155_584_512)
    act = M.activation_bytes(QWEN3_06B, tokens, M.MemoryPlan(**knob), packed_rows=packed, row_len=row_len)
    with_margin = fsdp_state + act * (1 + M.MARGIN_FRACTION) + M.MARGIN_BYTES
    print(f"{knob} {tokens}: measured {measured_gib} GiB, estimate + margin {with_margin / GIB:.2f} GiB")
    assert measured_gib * GIB <= with_margin <= (measured_gib * 1.1 + 1) * GIB


@pytest.mark.parametrize(
    "tokens,knob,measured_gib",
    [
        # H200 peaks of the one-rank path (no FSDP; the default on one GPU), 4a72a3d, trainer_gpu_h200_fa4.json.
        (65536, dict(ac="full", keep_attention=-1, offload_attention=True), 15.43),
        (65536, dict(ac="full"), 15.18),
        (32768, dict(ac="full", keep_attention=-1, offload_attention=True), 12.05),
        (32768, dict(ac="full"), 12.05),
        (16384, dict(ac="full", keep_attention=-1, offload_attention=True), 11.10),
        # The same path under a 16 GiB cap (expandable segments), trainer_gpu_h200_capped.json.
        (65536, dict(ac="full", keep_attention=-1, offload_attention=True, mlp_chunks=8), 15.07),
        (65536, dict(ac="full"), 15.17),
    ],
)
def test_estimates_with_their_margin_cover_the_measured_one_rank_peaks(tokens, knob, measured_gib):
    act = M.activation_bytes(QWEN3_06B, tokens, M.MemoryPlan(**knob), row_len=tokens)
    with_margin = ONE_RANK_STATE + act * (1 + M.MARGIN_FRACTION) + M.MARGIN_BYTES
    assert measured_gib * GIB <= with_margin <= (measured_gib * 1.1 + 1) * GIB


def test_a_64k_row_under_a_16_gib_cap_chunks_the_mlp_of_the_offload_that_ran_out_of_memory():
    # Measured on an H200 under `gpu_memory_fraction` = 16 GiB (15.93 allowed): the offload plan ran out of memory at
    # the first step (15.05 GiB allocated, 0.6 GiB of segments unusable beside it, with expandable segments too); full
    # recompute ran 14.6k tok/s at 15.17 GiB; the offload with the MLP in 8 chunks 17.6k at 15.07 GiB.
    capped = plan(65536, 65536, free_gib=15.93)
    assert knobs(capped) == ("full", -1, True, M.LAST_RESORT_MLP_CHUNKS) and capped.fits
    unchunked = M.MemoryPlan(ac="full", keep_attention=-1, offload_attention=True)
    assert M._with_estimate(unchunked, QWEN3_06B, 65536, capped.budget_bytes, 1024, 0, 65536).fits is False
    # A MoE layer leaves `mlp_chunks` alone: nothing is saved, so the estimate must not count a saving.
    moe = M.ModelShape(**{**QWEN3_06B.__dict__, "dense_mlp": False})
    chunked = M.MemoryPlan(ac="full", mlp_chunks=8)
    assert M.activation_bytes(moe, 65536, chunked) == M.activation_bytes(moe, 65536, M.MemoryPlan(ac="full"))


def test_state_and_budget_arithmetic():
    assert M.training_state_bytes(1000, 4, optimizer_allocated=False, grad_bytes=2) == 1000 * (8 + 2)
    assert M.training_state_bytes(1000, 4, optimizer_allocated=True, grad_bytes=4) == 4000  # resumed: moments exist
    assert M.activation_budget(10 * GIB, 4 * GIB) == 6 * GIB
    assert M.host_budget(64 * GIB, local_ranks=4) == 8 * GIB
    assert M.ModelShape.from_args(load_model(dict(TINY_QWEN3), seed=0).args) == M.ModelShape(
        hidden=32, layers=2, mlp_width=64, attn_width=32, heads=2, vocab=96,
        layer_params=2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64,
    )  # fmt: skip


def _components(*args: str, device: str = "cpu"):
    config = load_config(TrainerConfig, list(args))
    model = load_model(dict(TINY_QWEN3), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device(device))
    return SimpleNamespace(
        config=config, model=model, optimizer=optimizer, world=world, cp_size=1, memory_plan=None,
        logger=logging.getLogger("prime.trainer"),
    )  # fmt: skip


def _micro_batch(rows: int, seq: int, packed: bool = False):
    position_ids = torch.arange(seq).repeat(rows, 1)
    if packed:
        position_ids[:, seq // 2 :] -= seq // 2
    return SimpleNamespace(input_ids=torch.zeros(rows, seq, dtype=torch.long), position_ids=position_ids)


def test_the_trainer_applies_the_auto_plan_once_and_logs_it(monkeypatch, caplog):
    checkpointed = lambda c: [type(layer).__name__.startswith("Checkpointed") for layer in c.model.model.layers]  # noqa: E731
    # On CPU `auto` is no checkpointing.
    c = _components()
    with caplog.at_level(logging.INFO, logger="prime.trainer"):
        assert M.plan_memory(c, [_micro_batch(2, 32)]).ac == "none"
    assert "memory: no activation checkpointing for 64 tokens a micro-batch (parallel.ac = auto, on CPU)" in caplog.text
    assert checkpointed(c) == [False, False]

    # On a GPU the facts decide; here they are passed in: 10 kB free for 64 tokens of activations is full AC.
    c = _components(device="cuda")
    facts = []
    monkeypatch.setattr(M, "_budgets", lambda c: facts.append(1) or (10_000, 10**9))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prime.trainer"):
        first = M.plan_memory(c, [_micro_batch(2, 32, packed=True)])
        again = M.plan_memory(c, [_micro_batch(4, 32)])
    assert first is again and first.ac == "full" and len(facts) == 1
    assert checkpointed(c) == [True, True]
    assert len([r for r in caplog.records if r.message.startswith("memory: ")]) == 1
    assert "memory: full activation checkpointing" in caplog.text and "(parallel.ac = auto)" in caplog.text

    # A hand-set plan is logged as such and applied by the parallelize function, not here.
    c = _components("--parallel.ac", "full", "--parallel.ac-keep-attention", "-1", device="cuda")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prime.trainer"):
        assert knobs(M.plan_memory(c, [_micro_batch(1, 32)])) == ("full", -1, False, 0)
    assert "(parallel.ac = full)" in caplog.text and checkpointed(c) == [False, False]


def test_knobs_without_full_checkpointing_are_one_line_errors():
    for args in (["--parallel.ac-keep-attention", "-1"], ["--parallel.ac-mlp-chunks", "4"]):
        with pytest.raises(ValueError, match=r"needs ac = 'full' \(got ac = 'auto'\)") as e:
            load_config(TrainerConfig, args)
        assert "\n" not in str(e.value).strip().splitlines()[-1]
    assert load_config(TrainerConfig, []).parallel.ac == "auto"


def test_weight_gradients_go_into_matmuls_only_with_several_micro_batches_and_room(monkeypatch, caplog):
    """`prime_models.parallel.main_grad` on the one-rank path: its fp32 gradients stay allocated through forward and
    backward, so the trainer turns it on when a step has several micro-batches (one has nothing to sum) and the plan
    still fits beside them; the memory line says which."""
    from prime_models.parallel.mixed_precision import apply_mixed_precision

    def run(micro_batches: list, budget: int) -> tuple[bool, str]:
        c = _components("--parallel.ac", "full", device="cuda")
        mp = apply_mixed_precision(c.model, torch.bfloat16)
        monkeypatch.setattr(M, "_budgets", lambda c: (budget, 0))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="prime.trainer"):
            M.plan_memory(c, micro_batches)
        return bool(mp.main_grad_of), next(r.message for r in caplog.records if r.message.startswith("memory: "))

    two = [_micro_batch(2, 32), _micro_batch(2, 32)]
    c = _components()
    trainable = sum(p.numel() for p in c.model.parameters())
    shape = M.ModelShape.from_args(c.model.args)
    need = M._with_estimate(M.MemoryPlan("full"), shape, 64, 0, c.config.init.logprob_chunk_size, 0, 32)
    need = math.ceil(need.activation_bytes * (1 + M.MARGIN_FRACTION) + M.MARGIN_BYTES)
    fused, line = run(two, 10 * GIB)
    assert fused and line.endswith("; weight gradients summed in fp32 inside their matmuls")
    fused, line = run([_micro_batch(4, 32)], 10 * GIB)
    assert not fused and line.endswith("(parallel.ac = full)")
    # Room for the activations, not for fp32 gradients (2 bytes a parameter more than bf16 ones) beside them.
    fused, line = run(two, need + trainable)
    assert not fused and line.endswith("(fp32 ones held throughout would not fit)")
    fused, _ = run(two, need + 2 * trainable)
    assert fused


@pytest.mark.parametrize(
    "device,varlen,dtype,masked",
    [
        ("cpu", True, torch.bfloat16, True),
        ("cuda", True, torch.bfloat16, False),
        ("cuda", False, torch.bfloat16, True),
        ("cuda", True, torch.float32, True),
    ],
)
def test_packed_rows_count_masks_only_where_sdpa_builds_them(monkeypatch, device, varlen, dtype, masked):
    """torch's varlen kernel (packed bf16 rows on CUDA, CUDA graphs included) needs no [S, S] mask, so the plan does not
    budget one; CPU, fp32 activations (which the kernel does not take) or the kernel turned off still build masks."""
    from prime_models import kernels

    from tests.models.conftest import tiny_config

    monkeypatch.setattr(kernels, "SDPA_VARLEN", varlen)
    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: object())
    mb = SimpleNamespace(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    c = SimpleNamespace(
        model=load_model(tiny_config("qwen3"), dtype=dtype),
        world=SimpleNamespace(device=torch.device(device)),
    )
    assert M._packed_rows(c, [mb], rows=1) == (1 if masked else 0)


def test_the_plan_budgets_for_the_rows_as_packed_not_as_trimmed(caplog):
    """A step whose micro-batches reach the forward without their all-padding rows (a small first step) still gets a
    plan for full micro-batches: the next step may fill every row."""
    import numpy as np
    from prime_core.schemas.microbatch import MicroBatch
    from prime_trainer.rl.data import TensorMicroBatch

    mb = MicroBatch.empty(4, 16)
    mb.sample_ids[0, :5] = 0
    t = TensorMicroBatch.from_numpy(mb, torch.device("cpu"))
    assert tuple(t.input_ids.shape) == (1, 16) and t.sent_shape == (4, 16)
    assert np.array_equal(t.input_ids.numpy(), mb.input_ids[:1])
    with caplog.at_level(logging.INFO, logger="prime.trainer"):
        M.plan_memory(_components(), [t])
    assert "for 64 tokens a micro-batch" in caplog.text
