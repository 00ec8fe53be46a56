"""Per-sequence sampling from fp32 logits: greedy, temperature, top-k, top-p, each with its own torch.Generator.

Every sequence samples from its own row with its own generator, so a seeded request gives the same tokens whatever
else shares its batch. Returned log-probs never include the top-k/top-p truncation: ``processed`` is
log_softmax(logits / temperature) (temperature 0 counts as 1), ``raw`` is log_softmax(logits).
"""

from __future__ import annotations

import torch

from prime_inference.protocol import SamplingParams


def token_logprobs(logits_V: torch.Tensor, params: SamplingParams, mode: str) -> torch.Tensor:
    if mode == "processed" and params.temperature > 0:
        return torch.log_softmax(logits_V / params.temperature, dim=-1)
    return torch.log_softmax(logits_V, dim=-1)


def sample_token(
    logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator, banned: list[int] | None = None
) -> int:
    """Sample one token id. ``banned`` ids (e.g. EOS before min_tokens) get zero probability."""
    if banned:
        logits_V = logits_V.clone()
        logits_V[banned] = float("-inf")
    if params.temperature == 0:
        return int(torch.argmax(logits_V))
    scaled = logits_V / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
