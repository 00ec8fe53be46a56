"""Every objective on micro-batches without loss tokens: an all-padding one (``MicroBatch.empty``, what
``pad_to_common_count`` adds on a rank with fewer micro-batches) and one of real samples whose tokens are all masked
(a step whose groups were all filtered). Each must give a zero loss that still back-propagates, on one rank and when
one of two ranks holds only such micro-batches."""

import numpy as np
import pytest
import torch
from prime_core.config.losses import (
    CISPOLossConfig,
    CustomLossConfig,
    DPPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    IPOLossConfig,
)
from prime_core.schemas.microbatch import MicroBatch
from prime_trainer.rl.data import TensorMicroBatch
from prime_trainer.rl.loss import LOSSES, LossInputs, build_objective, compute_loss

from tests.ranks import leave_group

ROWS, SEQ = 2, 8
CONFIGS = {
    "grpo": GRPOLossConfig,
    "gspo": GSPOLossConfig,
    "cispo": CISPOLossConfig,
    "dppo": DPPOLossConfig,
    "ipo": IPOLossConfig,
    "custom": lambda **options: CustomLossConfig(import_path="tests.trainer.test_loss:Reinforce", **options),
}
OPTIONS = [
    {},
    {"normalization": "sequence"},
    {"kl_coef": 0.1, "entropy_coef": 0.01},
]


def _config(loss_type: str, options: dict):
    return CONFIGS[loss_type](**options)


def _padding_batch() -> MicroBatch:
    """Two samples per row, none with a loss token."""
    mb = MicroBatch.empty(ROWS, SEQ)
    mb.input_ids[:] = 3
    mb.sample_ids[:] = np.repeat(np.arange(2 * ROWS).reshape(ROWS, 2), SEQ // 2, axis=1)
    mb.position_ids[:] = np.tile(np.arange(SEQ // 2), 2)
    mb.advantages[:] = 0.5
    return mb


def _real_batch(seed: int) -> MicroBatch:
    rng = np.random.default_rng(seed)
    mb = _padding_batch()
    mb.loss_mask[:, 2 : SEQ // 2] = True
    mb.loss_mask[:, SEQ // 2 + 1 :] = True
    mb.advantages[:] = rng.standard_normal((ROWS, 1))
    mb.inference_logprobs[:] = np.where(mb.loss_mask, -1.0 + 0.1 * rng.standard_normal((ROWS, SEQ)), 0.0)
    return mb


def _inputs(mb: MicroBatch, seed: int) -> tuple[LossInputs, torch.Tensor]:
    t = TensorMicroBatch.from_numpy(mb, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    # An all-padding micro-batch reaches the loss as one row (`MicroBatch.without_empty_rows`).
    shape = t.loss_mask.shape
    logprobs = (-1.0 + 0.1 * torch.randn(shape, generator=gen)).requires_grad_(True)
    entropy = torch.rand(shape, generator=gen).requires_grad_(True)
    return LossInputs(logprobs, t.inference_logprobs, t.advantages, t.loss_mask, t.sample_ids, entropy), logprobs


def _loss(config, mb: MicroBatch, seed: int, num_tokens: int, num_samples: int) -> tuple[float, torch.Tensor]:
    inputs, logprobs = _inputs(mb, seed)
    loss, stats = compute_loss(build_objective(config), config, inputs, num_tokens=num_tokens, num_samples=num_samples)
    loss.backward()
    assert all(torch.isfinite(v).all() for v in stats.values())
    return loss.item(), logprobs.grad


def test_every_loss_is_tested():
    assert set(CONFIGS) == set(LOSSES)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
@pytest.mark.parametrize("make", [lambda: MicroBatch.empty(ROWS, SEQ), _padding_batch], ids=["empty", "padding"])
def test_no_loss_tokens_gives_zero_loss(loss_type, options, make):
    # Counts 0 as on a step with nothing to train, and counts of another rank's tokens as on a padding rank.
    for num_tokens, num_samples in [(0, 0), (10, 4)]:
        loss, grad = _loss(_config(loss_type, options), make(), 0, num_tokens, num_samples)
        assert loss == 0.0
        assert grad is not None and not grad.any()


def _rank(rank: int, world: int, init_file: str, loss_type: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Rank 0 holds the step's data; rank 1 holds a filtered step's samples and the padding that evens the count.
        batches = [_real_batch(0), _real_batch(1)] if rank == 0 else [_padding_batch(), MicroBatch.empty(ROWS, SEQ)]
        counts = torch.tensor(
            [
                sum(int(b.loss_mask.sum()) for b in batches),
                sum(len(np.unique(b.sample_ids[b.loss_mask])) for b in batches),
            ]
        )
        dist.all_reduce(counts)
        results = {}
        for options_index, options in enumerate(OPTIONS):
            total = torch.zeros(())
            for i, mb in enumerate(batches):
                loss, grad = _loss(_config(loss_type, options), mb, i, int(counts[0]), int(counts[1]))
                total += loss
                if rank == 1:
                    assert not grad.any()
            dist.all_reduce(total)
            results[options_index] = total.item()
        if rank == 0:
            torch.save(results, out)
    finally:
        leave_group()


@pytest.mark.integration
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_rank_without_loss_tokens_adds_nothing(loss_type, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "losses.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), loss_type, str(out)), nprocs=2, join=True)
    batches = [_real_batch(0), _real_batch(1)]
    num_tokens = sum(int(b.loss_mask.sum()) for b in batches)
    num_samples = sum(len(np.unique(b.sample_ids[b.loss_mask])) for b in batches)
    for options_index, options in enumerate(OPTIONS):
        single = sum(
            _loss(_config(loss_type, options), mb, i, num_tokens, num_samples)[0] for i, mb in enumerate(batches)
        )
        assert torch.load(out)[options_index] == pytest.approx(single, rel=1e-6)
