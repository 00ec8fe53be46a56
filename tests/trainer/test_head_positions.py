"""The LM head runs only where the loss reads: positions that predict a loss token (topped up to a bucket of
positions). The step's loss, statistics and gradients are those of the head on every position; a custom loss, which
may read any position, still gets them all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prime_core.config.trainer import TrainerConfig
from prime_core.schemas.microbatch import MicroBatch
from prime_trainer.model import token_logprobs
from prime_trainer.rl import data as rl_data
from prime_trainer.rl.data import TensorMicroBatch, head_positions
from prime_trainer.rl.loss import build_objective
from prime_trainer.rl.train import forward_backward

from tests.trainer.test_empty_rows import _step, _with_empty_rows
from tests.trainer.test_host_syncs import VOCAB, components
from tests.trainer.trainer_utils import make_step_batches

SEQ = 32

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def test_head_positions_cover_every_loss_token_in_a_bucket_of_distinct_positions():
    mb = make_step_batches(0, 1, 3, SEQ, VOCAB)[0]
    positions = head_positions(mb.loss_mask, bucket=8)
    assert positions is not None and len(positions) % 8 == 0
    assert np.array_equal(positions, np.unique(positions))  # sorted, distinct
    rows, cols = np.nonzero(mb.loss_mask)
    assert set((rows * SEQ + cols - 1).tolist()) <= set(positions.tolist())
    assert int(mb.loss_mask.sum()) <= len(positions) < int(mb.loss_mask.sum()) + 8
    assert head_positions(mb.loss_mask, bucket=4096) is None  # the bucket covers every position: no selection
    assert len(head_positions(MicroBatch.empty(2, SEQ).loss_mask, bucket=8)) == 8  # nothing to train: one bucket


def test_log_probs_on_loss_tokens_equal_those_of_the_whole_head(tiny_model_dir, tmp_path, monkeypatch):
    c = components(TrainerConfig, tiny_model_dir, tmp_path)
    mb = make_step_batches(1, 1, 2, SEQ, VOCAB)[0]
    monkeypatch.setattr(rl_data, "HEAD_POSITIONS_BUCKET", 8)
    t = TensorMicroBatch.from_numpy(mb, torch.device("cpu"))
    assert t.head_positions is not None and len(t.head_positions) < mb.loss_mask.size
    out = {}
    for name, positions in (("all", None), ("loss", t.head_positions)):
        lp, ent = token_logprobs(c.model, t.input_ids, t.position_ids, temperature=0.7, chunk_size=16,
                                 entropy_grad=True, packing=t.packing, head_positions=positions)  # fmt: skip
        out[name] = (lp, ent)
    mask = t.loss_mask
    torch.testing.assert_close(out["loss"][0][mask], out["all"][0][mask], rtol=0, atol=0)
    torch.testing.assert_close(out["loss"][1][mask], out["all"][1][mask], rtol=0, atol=0)


@pytest.mark.parametrize("loss", ["grpo", "gspo", "custom"])
def test_the_step_is_the_same_with_the_head_on_loss_tokens_only(loss, tiny_model_dir, tmp_path, monkeypatch):
    args = ["--loss.type", loss, "--loss.kl-coef", "0.1", "--loss.entropy-coef", "0.01"]
    if loss == "custom":
        args = ["--loss.type", "custom", "--loss.import-path", "tests.trainer.test_loss:Reinforce"]
    c = components(TrainerConfig, tiny_model_dir, tmp_path, *args)
    objective = build_objective(c.config.loss)
    real = make_step_batches(3, 2, 2, SEQ, VOCAB)
    batches = [real[0], _with_empty_rows(real[1], empty=1), MicroBatch.empty(2, SEQ)]
    monkeypatch.setattr(rl_data, "HEAD_POSITIONS_BUCKET", 8)

    seen = []
    original = type(c.model).forward

    def spy(self, *a, **kw):
        seen.append(kw.get("head_positions") is not None)
        return original(self, *a, **kw)

    results = {}
    for on in (False, True):
        monkeypatch.setattr(rl_data, "HEAD_ON_LOSS_TOKENS", on)
        monkeypatch.setattr(type(c.model), "forward", spy)
        seen.clear()
        results[on] = (*_step(c, objective, batches), list(seen))
    totals_a, counts_a, grads_a, _, seen_a = results[False]
    totals_b, counts_b, grads_b, _, seen_b = results[True]
    assert not any(seen_a)
    assert all(seen_b) == (loss != "custom") and any(seen_b) == (loss != "custom")
    assert counts_a == counts_b
    for k in totals_a:
        assert totals_b[k] == pytest.approx(totals_a[k], rel=1e-5, abs=1e-7), k
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_forward_backward_runs_with_positions_on_a_step_with_no_loss_tokens(tiny_model_dir, tmp_path, monkeypatch):
    c = components(TrainerConfig, tiny_model_dir, tmp_path)
    monkeypatch.setattr(rl_data, "HEAD_POSITIONS_BUCKET", 8)
    t = TensorMicroBatch.from_numpy(MicroBatch.empty(2, SEQ), torch.device("cpu"))
    assert t.head_positions is not None and len(t.head_positions) == 8
    totals, counts = forward_backward(c, build_objective(c.config.loss), [t], 1.0)
    assert counts[0] == 0 and totals["loss"] == 0.0
