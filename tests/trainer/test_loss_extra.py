"""A new per-token input reaches the loss with code only in its producer and in the loss: the orchestrator packs
``Sample.extra`` into the micro-batch file and the trainer hands ``MicroBatch.extra`` to the objective as
``LossInputs.extra``; nothing in between names the array."""

from __future__ import annotations

import json
import random

import pytest
import torch
from prime_core.run_dir import RunDir
from prime_core.transport import FilesystemSender
from prime_orchestrator.packing import Sample, pack
from prime_trainer.rl.loss import LossInputs, PolicyTerm

from tests.trainer.trainer_utils import read_trainer_metrics, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess")]

SEQ_LEN, ROWS = 48, 2


class TeacherGuided:
    """The loss side: REINFORCE on A + beta * (teacher log-prob - inference log-prob) per token, reading the teacher's
    log-probs from ``b.extra``. Writes what it received to ``record`` (one JSON line per micro-batch) for the test."""

    def __init__(self, beta: float, record: str):
        self.beta, self.record = beta, record

    def __call__(self, b: LossInputs) -> PolicyTerm:
        teacher, mask = b.extra["teacher_logprobs"], b.loss_mask
        with open(self.record, "a") as f:
            seen = {"loss_token_sum": float((teacher * mask).sum()), "padding_abs_sum": float(teacher[b.sample_ids < 0].abs().sum()),
                    "dtype": str(teacher.dtype), "shape": list(teacher.shape)}  # fmt: skip
            f.write(json.dumps(seen) + "\n")
        advantages = b.advantages + self.beta * (teacher - b.inference_logprobs) * mask
        none = torch.zeros_like(mask)
        return PolicyTerm(loss=-advantages.detach() * b.logprobs * mask, masked=none, clipped=none)


def produce(out, step: int) -> tuple[int, float]:
    """The producer side: samples carrying a per-token teacher log-prob, packed and sent as the orchestrator does.
    Returns the step's micro-batch count and the sum of the teacher's values over its loss tokens."""
    rng = random.Random(step)
    samples = []
    for i in range(6):
        length = rng.randint(6, SEQ_LEN // 2)
        prompt = rng.randint(2, length - 2)
        mask = [t >= prompt for t in range(length)]
        samples.append(
            Sample(
                token_ids=[rng.randint(1, 90) for _ in range(length)],
                loss_mask=mask,
                logprobs=[-4.5 * m for m in mask],
                advantage=rng.uniform(-1, 1),
                weight_step=step,
                extra={"teacher_logprobs": [-0.5 - (i + t) / 50 for t in range(length)]},
            )
        )
    res = pack(samples, step=step, seq_len=SEQ_LEN, num_ranks=1, micro_batch_rows=ROWS, temperature=1.0)
    FilesystemSender(RunDir(out)).send(step, 0, res.metas[0], res.micro_batches[0])
    expected = sum(v for s in samples for v, m in zip(s.extra["teacher_logprobs"], s.loss_mask, strict=True) if m)
    return len(res.micro_batches[0]), expected


def test_a_per_token_array_flows_from_the_packer_to_the_loss(tiny_model_dir, tmp_path):
    out, record = tmp_path / "run", tmp_path / "seen.jsonl"
    produced = [produce(out, step) for step in range(2)]
    run_cli(["--model.name", str(tiny_model_dir), "--output-dir", str(out), "--max-steps", "2", "--seq-len",
             str(SEQ_LEN), "--log.level", "warning", "--loss.type", "custom",
             "--loss.import-path", "tests.trainer.test_loss_extra:TeacherGuided",
             "--loss.kwargs", json.dumps({"beta": 0.5, "record": str(record)})])  # fmt: skip

    assert sorted(read_trainer_metrics(out)) == [0, 1]
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(seen) == sum(n for n, _ in produced)  # one call per micro-batch of each step
    # A micro-batch's all-padding rows stay out of the forward, so the last may hold fewer rows.
    assert all(s["dtype"] == "torch.float32" and 1 <= s["shape"][0] <= ROWS and s["shape"][1] == SEQ_LEN for s in seen)
    assert all(s["padding_abs_sum"] == 0 for s in seen)
    start = 0
    for n, expected in produced:
        got = sum(s["loss_token_sum"] for s in seen[start : start + n])
        assert got == pytest.approx(expected, rel=1e-5)
        start += n
