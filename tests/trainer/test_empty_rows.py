"""All-padding rows stay out of the forward: the last micro-batch of a step (packing fills it with empty rows) and a
rank's filler micro-batches train on their real rows only, and the step's loss, statistics and gradients are those of
the untrimmed micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prime_core.config.trainer import TrainerConfig
from prime_core.schemas.microbatch import MICROBATCH_FIELDS, MicroBatch, stack_rows
from prime_trainer.rl import data as rl_data
from prime_trainer.rl.data import TensorMicroBatch
from prime_trainer.rl.loss import build_objective
from prime_trainer.rl.train import forward_backward

from tests.trainer.test_host_syncs import VOCAB, components
from tests.trainer.trainer_utils import make_step_batches

SEQ = 32

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _with_empty_rows(mb: MicroBatch, empty: int) -> MicroBatch:
    """``mb``'s rows with ``empty`` all-padding rows between them, as packing leaves them at a step's end."""
    rows = [MicroBatch(**{f: getattr(mb, f)[r : r + 1] for f in MICROBATCH_FIELDS}) for r in range(mb.shape[0])]
    filler = [MicroBatch.empty(1, mb.shape[1]) for _ in range(empty)]
    return stack_rows([rows[0], *filler, *rows[1:]])


def test_without_empty_rows_keeps_every_field_of_the_rows_with_samples():
    mb = _with_empty_rows(make_step_batches(0, 1, 2, SEQ, VOCAB)[0], empty=2)
    mb.extra = {"teacher": np.arange(mb.input_ids.size, dtype=np.float32).reshape(mb.shape)}
    mb.mrope_position_ids = np.stack([mb.position_ids * k for k in (1, 2, 3)])
    trimmed = mb.without_empty_rows()
    assert trimmed.shape == (2, SEQ)
    kept = [0, 3]
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "sample_ids"):
        assert np.array_equal(getattr(trimmed, name), getattr(mb, name)[kept]), name
    assert np.array_equal(trimmed.extra["teacher"], mb.extra["teacher"][kept])
    assert np.array_equal(trimmed.mrope_position_ids, mb.mrope_position_ids[:, kept])
    assert mb.shape == (4, SEQ)  # the original is left as it was


def test_an_all_padding_micro_batch_keeps_one_row_and_a_full_one_is_unchanged():
    assert MicroBatch.empty(8, SEQ).without_empty_rows().shape == (1, SEQ)
    full = make_step_batches(1, 1, 3, SEQ, VOCAB)[0]
    assert full.without_empty_rows() is full
    odd = MicroBatch.empty(3, SEQ)
    odd.loss_mask[2, 4] = True  # a loss token on a padding id: never dropped
    assert np.array_equal(odd.without_empty_rows().loss_mask, odd.loss_mask[[2]])


def _step(c, objective, batches: list[MicroBatch]) -> tuple[dict, tuple, dict[str, torch.Tensor], list]:
    shapes = []
    hook = c.model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        c.model.zero_grad(set_to_none=True)
        tensors = [TensorMicroBatch.from_numpy(mb, torch.device("cpu")) for mb in batches]
        totals, counts = forward_backward(c, objective, tensors, 1.0)
    finally:
        hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in c.model.named_parameters() if p.grad is not None}
    return totals, counts, grads, shapes


def test_the_step_trains_on_the_real_rows_only_and_gives_the_same_update(tiny_model_dir, tmp_path, monkeypatch):
    c = components(TrainerConfig, tiny_model_dir, tmp_path, "--loss.type", "grpo", "--loss.normalization", "sequence")
    objective = build_objective(c.config.loss)
    real = make_step_batches(2, 2, 2, SEQ, VOCAB)
    # A step as packing leaves it: a full micro-batch, one with a padding row, then a rank's all-padding filler.
    batches = [real[0], _with_empty_rows(real[1], empty=2), MicroBatch.empty(4, SEQ)]

    monkeypatch.setattr(rl_data, "TRIM_EMPTY_ROWS", False)
    totals_a, counts_a, grads_a, shapes_a = _step(c, objective, batches)
    monkeypatch.setattr(rl_data, "TRIM_EMPTY_ROWS", True)
    totals_b, counts_b, grads_b, shapes_b = _step(c, objective, batches)

    assert shapes_a == [(2, SEQ), (4, SEQ), (4, SEQ)]
    assert shapes_b == [(2, SEQ), (2, SEQ), (1, SEQ)]  # 5 rows of 10 through the model
    assert counts_a == counts_b
    for k in totals_a:
        assert totals_b[k] == pytest.approx(totals_a[k], rel=1e-5, abs=1e-7), k
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
