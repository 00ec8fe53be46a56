"""vLLM's log-probs as the engine interface holds them: sampled tokens' values, top-k alternatives, prompt log-probs.
No vllm import: the values are read off vLLM's objects by their fields."""

from __future__ import annotations

from typing import Any


def split_logprobs(token_ids: Any, entries: Any, k: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """(sampled tokens' log-probs, top-k alternatives per token or None for k = 0) from vLLM's sample log-probs.

    ``entries`` is vLLM's `FlatLogprobs` (what ``flat_logprobs=True`` returns): flat lists where position i owns
    ``[start_indices[i], end_indices[i])``, the sampled token first, then the top k by rank. With k = 0 every
    position holds one entry, so the log-prob list is handed over as is: no Python object per token (RL asks for
    exactly this, and a whole batch of rollouts lands on the event loop at once when it finishes together).
    A plain list of ``{token id: Logprob}`` dicts (vLLM without flat log-probs) is read the slow way.
    """
    if isinstance(entries, list):
        lps = [entry[tid].logprob for tid, entry in zip(token_ids, entries, strict=True)]
        if k <= 0:
            return lps, None
        top = []
        for tid, entry in zip(token_ids, entries, strict=True):
            ranked = sorted(((t, lp) for t, lp in entry.items() if t != tid), key=lambda x: x[1].rank or 0)
            top.append({t: lp.logprob for t, lp in ranked[:k]})
        return lps, top
    starts, values = entries.start_indices, entries.logprobs
    if len(starts) != len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {len(starts)} positions, {len(token_ids)} tokens")
    lps = values if len(values) == len(starts) else [values[s] for s in starts]
    if k <= 0:
        return lps, None
    ids, ends = entries.token_ids, entries.end_indices
    top = [
        dict([(ids[i], values[i]) for i in range(s + 1, e) if ids[i] != tid][:k])
        for tid, s, e in zip(token_ids, starts, ends, strict=True)
    ]
    return lps, top


def prompt_logprobs_of(entries: Any) -> list[dict[int, tuple[float, int]] | None]:
    """vLLM's prompt log-probs as the engine interface holds them: per position None (the first) or {token id:
    (log-prob, rank)}, from a list of ``{token id: Logprob}`` dicts or a `FlatLogprobs`."""
    if isinstance(entries, list):
        return [None if e is None else {t: (lp.logprob, lp.rank or 0) for t, lp in e.items()} for e in entries]
    ids, values, ranks = entries.token_ids, entries.logprobs, entries.ranks
    out: list[dict[int, tuple[float, int]] | None] = []
    for s, e in zip(entries.start_indices, entries.end_indices, strict=True):
        out.append({ids[i]: (values[i], ranks[i] or 0) for i in range(s, e)} or None)
    return out
