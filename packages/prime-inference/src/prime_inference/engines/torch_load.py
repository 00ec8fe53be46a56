"""The torch engine's load as ``/health`` reports it (`prime_core.schemas.health.HealthResponse`).

What bounds the engine's batch: its KV cache has ``max_batch_size`` slots (`prime_models.layers.KVCache`), each
holding up to ``max_model_len`` positions of one running sequence; a request waits while every slot is taken. So its
capacity is ``max_batch_size x max_model_len`` tokens, and its usage is the tokens the running sequences have cached
over that capacity: the measure vLLM reports (KV blocks in use over its blocks). Slots, like vLLM's ``max_num_seqs``,
bound the batch separately: short sequences can take every slot while using little of the cache; requests then wait
(``waiting`` > 0) at a low usage. The engine never preempts: a sequence keeps its slot until it finishes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def cached_tokens(seq: Any) -> int:
    """Positions a running sequence holds in the cache: its prompt, then every sampled token but the newest, which is
    the next decode step's input."""
    return len(seq.request.prompt_ids) + max(len(seq.output_ids) - 1, 0)


def kv_cache_usage(running: Iterable[Any], num_slots: int, max_len: int) -> float:
    """Cached tokens of ``running`` (the engine's `_Sequence` objects) over ``num_slots x max_len``, in 0..1.

    Called from the event loop while the scheduler thread runs: ``running`` is a snapshot (a copy of the list); a
    sequence's lengths only grow, so a read between two appends is at most one token short."""
    capacity = num_slots * max_len
    return min(1.0, sum(cached_tokens(s) for s in running) / capacity) if capacity > 0 else 0.0


def load_fields(running: list[Any], num_slots: int, max_len: int) -> dict[str, Any]:
    """`EngineInfo`'s load fields from a snapshot of the running sequences; ``preemptions`` is 0 (never any)."""
    return {"running": len(running), "kv_cache_usage": kv_cache_usage(running, num_slots, max_len), "preemptions": 0}
