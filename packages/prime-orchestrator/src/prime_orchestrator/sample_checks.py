"""What an inference server answered, checked before the trainer sees it.

The train client (verifiers over ``renderers``) checks the shape of a ``/inference/v1/generate`` answer: as many
log-probs as tokens, each a finite number. It does not check the values: a broken or hostile server could answer
token ids below zero or past the model's vocabulary (an out-of-range embedding index on the trainer's GPU: a device
assert, the whole run lost) or positive log-probs (an importance ratio the loss never sees from a real policy); or
no token at all (an empty completion "cut at length": vLLM
always returns the stop token or at least one sampled token), a rollout that trains nothing but whose reward still
moves its group's baseline. Each would reach the packed micro-batch, or the advantages, as it came. ``check_sequences``
names the first such value of a rollout, which then fails (no tokens, counted) instead of training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from prime_core.io import read_regular
from prime_core.schemas.rollout import RolloutResult

# A real log-softmax is <= 0; float32 rounding of a near-certain token can land a hair above it.
MAX_LOGPROB = 1e-3


def vocab_size(model_dir: str) -> int | None:
    """The model's embedding rows (``config.json``'s ``vocab_size``, a VLM's ``text_config``'s); None when the model
    is not a local directory (a hub id: the server's tokenizer is all there is to go by)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(read_regular(path, "a model config"))  # a FIFO there blocked the orchestrator in open
    except (OSError, ValueError):  # UnreadableFile (a FIFO, a device) is a ValueError
        return None
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def check_sequences(result: RolloutResult, *, vocab: int | None) -> str | None:
    """The first value of ``result``'s trained sequences that no real policy samples, in one line; None if none."""
    for t, trace in enumerate(result.traces):
        # A trace whose replies the env replaced (an `@vf.intercept` on the response) holds none of their tokens.
        empty = not any(True in seq.loss_mask for seq in trace.sequences)
        if trace.trainable and empty and not trace.replaced_replies:
            return f"no sampled token in trace {t} (an empty completion)"
        for s, seq in enumerate(trace.sequences):
            where = f"trace {t} sequence {s}"
            for i, token in enumerate(seq.token_ids):
                if type(token) is not int or token < 0 or (vocab is not None and token >= vocab):
                    bound = f" (vocabulary {vocab})" if vocab is not None else ""
                    return f"token id {token!r} at {where} position {i}{bound}"
            for i, (sampled, logprob) in enumerate(zip(seq.loss_mask, seq.logprobs, strict=True)):
                if sampled and (not math.isfinite(logprob) or logprob > MAX_LOGPROB):
                    return f"log-prob {logprob!r} of a sampled token at {where} position {i}"
    return None
