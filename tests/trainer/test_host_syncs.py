"""The trainer's steps read nothing back from the device per micro-batch (issue 43): on a GPU each read waits for the
stream, so one per micro-batch leaves the GPU idle while the host launches the next forward. Counted on CPU with
torch.profiler (``aten::_local_scalar_dense`` is every ``.item()``/``bool()``/``tolist()``; ``nonzero`` and
``unique`` read sizes back): a step of three micro-batches reads exactly as much as a step of one. What replaces the
reads (counts, per-sample segments and row packing computed from the host arrays) gives the same values."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from prime_core.config import load_config
from prime_core.config.trainer import SFTConfig, TrainerConfig
from prime_models.layers.attention import (
    build_attention_metadata,
    cu_seqlens_from_position_ids,
    row_packing,
    use_row_packing,
)
from prime_models.parallel.mixed_precision import apply_mixed_precision
from prime_trainer import common
from prime_trainer.rl.data import TensorMicroBatch
from prime_trainer.rl.loss import LOSSES, LossInputs, build_objective, compute_loss
from prime_trainer.rl.train import forward_backward
from prime_trainer.sft.train import sft_step
from torch.profiler import ProfilerActivity, profile

from tests.trainer.test_loss_empty import CONFIGS, OPTIONS, _padding_batch, _real_batch
from tests.trainer.trainer_utils import make_step_batches

READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::masked_select")
SEQ, VOCAB = 32, 96


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def reads(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter({e.key: e.count for e in prof.key_averages() if e.key in READS})


def components(config_cls, model_dir, tmp_path, *args: str):
    argv = ["--model.name", str(model_dir), "--device", "cpu", "--output-dir", str(tmp_path), "--bench", *args]
    c = common.setup(load_config(config_cls, argv), "trainer" if config_cls is TrainerConfig else "sft")
    apply_mixed_precision(c.model, torch.bfloat16)  # the one-GPU path: a bf16 working copy and its hooks
    return c


def micro_batches(count: int) -> list[TensorMicroBatch]:
    # Packed rows (several samples each): attention needs their layout, the sequence loss their samples.
    return [TensorMicroBatch.from_numpy(mb, torch.device("cpu")) for mb in make_step_batches(0, count, 2, SEQ, VOCAB)]


@pytest.mark.parametrize(
    "loss_args",
    [[], ["--loss.type", "gspo"], ["--loss.type", "grpo", "--loss.normalization", "sequence", "--loss.kl-coef", "0.1"]],
    ids=["grpo", "gspo", "sequence"],
)
def test_the_rl_step_reads_nothing_back_per_micro_batch(loss_args, tiny_model_dir, tmp_path):
    c = components(TrainerConfig, tiny_model_dir, tmp_path, *loss_args)
    objective = build_objective(c.config.loss)
    one, three = micro_batches(1), micro_batches(3)
    forward_backward(c, objective, three, 1.0)  # the memory plan and lazy set-ups happen once
    counts = {n: reads(lambda mbs=mbs: forward_backward(c, objective, mbs, 1.0)) for n, mbs in ((1, one), (3, three))}
    assert counts[3] == counts[1], counts


def test_the_sft_step_reads_nothing_back_per_micro_batch(tiny_model_dir, tmp_path):
    c = components(SFTConfig, tiny_model_dir, tmp_path)
    one, three = micro_batches(1), micro_batches(3)
    sft_step(c, 0, three)
    assert reads(lambda: sft_step(c, 1, three)) == reads(lambda: sft_step(c, 2, one))


def test_host_counts_and_segments_equal_what_the_device_tensors_give():
    for mb in [*make_step_batches(3, 2, 3, SEQ, VOCAB), _padding_batch(), _real_batch(0)]:
        t = TensorMicroBatch.from_numpy(mb, torch.device("cpu"))
        assert t.num_tokens == int((t.sample_ids >= 0).sum())
        assert t.num_loss_tokens == int(t.loss_mask.sum())
        assert t.num_loss_samples == torch.unique(t.sample_ids[t.loss_mask]).numel()
        # One dense index per sample with a loss token, in the order of the sample ids.
        ids = t.sample_ids[t.loss_mask]
        assert torch.equal(t.segments[t.loss_mask], torch.unique(ids, return_inverse=True)[1])
        assert not t.segments[~t.loss_mask].any()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_host_segments_give_the_same_loss_and_gradient(loss_type, options):
    config = CONFIGS[loss_type](**options)
    for make in (lambda: _real_batch(0), _padding_batch, lambda: make_step_batches(5, 1, 2, 8, VOCAB)[0]):
        t = TensorMicroBatch.from_numpy(make(), torch.device("cpu"))
        results = []
        for segments in (None, (t.segments, t.num_loss_samples)):
            gen = torch.Generator().manual_seed(0)
            logprobs = (-1.0 + 0.1 * torch.randn(t.loss_mask.shape, generator=gen)).requires_grad_(True)
            entropy = torch.rand(t.loss_mask.shape, generator=gen)
            inputs = LossInputs(logprobs, t.inference_logprobs, t.advantages, t.loss_mask, t.sample_ids, entropy,
                                segments=segments)  # fmt: skip
            loss, stats = compute_loss(build_objective(config), config, inputs, num_tokens=20, num_samples=5)
            loss.backward()
            results.append((loss.detach(), logprobs.grad, stats))
        (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = results
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
        assert all(torch.equal(stats_a[k], stats_b[k]) for k in stats_a)


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_attention_takes_the_rows_packing_from_the_host(backend):
    packed = torch.from_numpy(np.concatenate([np.arange(5), np.arange(3)])).repeat(2, 1)
    unpacked = torch.arange(8).repeat(2, 1)
    for position_ids in (packed, unpacked):
        layout = row_packing(position_ids)
        cu, max_seqlen = cu_seqlens_from_position_ids(position_ids)
        assert torch.equal(layout.cu_seqlens, cu) and layout.max_seqlen == max_seqlen
        assert layout.packed == (position_ids is packed)
        expected = build_attention_metadata(position_ids, backend)
        with use_row_packing(layout):
            assert reads(lambda p=position_ids: build_attention_metadata(p, backend)) == collections.Counter()
            got = build_attention_metadata(position_ids, backend)
        for field in ("mask_B1SS", "cu_seqlens"):
            a, b = getattr(got, field), getattr(expected, field)
            assert (a is None and b is None) or torch.equal(a, b)
        assert got.max_seqlen == expected.max_seqlen
        # A layout of other rows is not used for these.
        with use_row_packing(row_packing(position_ids[:1])):
            assert build_attention_metadata(position_ids, backend).max_seqlen == expected.max_seqlen
