"""What a trainer rank reports to the run's watchdog while it publishes and checkpoints (``prime_core.progress``):
work whose bound the watchdog learns from earlier steps, or, for a transport that hands the weights over (broadcast,
CUDA IPC), a wait on inference bounded by the transport's own timeouts (inference joins, then the tensors go)."""

from __future__ import annotations

import contextlib

from prime_core import progress

from prime_trainer.common import Components
from prime_trainer.weights import WeightPublisher


def publishing(c: Components, step: int) -> contextlib.AbstractContextManager[None]:
    # A transport that hands the tensors over after STABLE (broadcast, CUDA IPC) waits for inference to take them.
    delivers = type(c.publisher).deliver is not WeightPublisher.deliver
    if delivers and step != c.config.max_steps:
        what = f"sending weights step {step} to inference (weights.broadcast.timeout_s twice: join, then send)"
        return progress.activity(what, limit_s=2 * c.config.weights.broadcast.timeout_s, waits_for="inference")
    return progress.activity(f"publishing weights step {step}", kind="publish")


def checkpointing(c: Components, step: int) -> contextlib.AbstractContextManager[None]:
    if c.config.bench or not c.ckpt.due(step, c.config.max_steps):
        return contextlib.nullcontext()
    return progress.activity(f"checkpointing step {step}", kind="checkpoint")
