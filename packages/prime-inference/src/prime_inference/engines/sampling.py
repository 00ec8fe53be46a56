"""Per-sequence logits processing and sampling from fp32 logits, in vLLM's order, each with its own torch.Generator.

Order (vLLM 0.26's sampler): a grammar mask (structured output), ``allowed_token_ids``, ``logit_bias`` and the
``min_tokens`` ban, then repetition / frequency / presence penalties; greedy takes the argmax there, random sampling
goes on with temperature, ``min_p``, top-k and top-p. Log-probs: ``raw`` is log_softmax of the logits before any of
this except the grammar mask; ``processed`` is log_softmax of the logits the token was drawn from (for greedy: after
the penalties, without temperature). Every sequence samples from its own row with its own generator, so a seeded
request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prime_inference.protocol import RequestError, SamplingParams

PROMPT_LOGPROBS_CHUNK = 512
"""Prompt positions whose log-probs are computed together."""


def apply_penalties(
    logits_V: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output tokens, frequency and presence over output tokens."""
    vocab = logits_V.numel()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits_V.device)
        seen[torch.tensor([t for t in (*prompt_ids, *output_ids) if t < vocab], dtype=torch.long)] = True
        penalized = torch.where(
            logits_V > 0, logits_V / params.repetition_penalty, logits_V * params.repetition_penalty
        )
        logits_V = torch.where(seen, penalized, logits_V)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(logits_V.device, logits_V.dtype)
        logits_V = logits_V - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(counts)
    return logits_V


def process_logits(
    logits_V: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    banned: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits greedy decoding takes the argmax of: allowed ids, logit bias, bans, penalties."""
    device, dtype = logits_V.device, logits_V.dtype
    if params.allowed_token_ids is not None:
        keep = torch.full_like(logits_V, float("-inf"))
        ids = params.derived(("allowed", device), lambda: torch.tensor(params.allowed_token_ids, device=device))
        logits_V = keep.index_copy(0, ids, logits_V[ids])
    if params.logit_bias:
        ids, bias = params.derived(("bias", device, dtype), lambda: (
            torch.tensor(list(params.logit_bias), dtype=torch.long, device=device),
            torch.tensor(list(params.logit_bias.values()), dtype=dtype, device=device),
        ))  # fmt: skip
        logits_V = logits_V.index_add(0, ids, bias)
    if banned is not None and len(banned):
        logits_V = logits_V.clone()
        logits_V[torch.as_tensor(banned, dtype=torch.long, device=device)] = float("-inf")
    if params.has_penalties:
        logits_V = apply_penalties(logits_V, params, prompt_ids, output_ids)
    return logits_V


def truncate(scaled_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """min_p, top-k and top-p on temperature-scaled logits: what falls outside gets -inf."""
    if params.min_p > 0.0:
        probs = torch.softmax(scaled_V, dim=-1)
        scaled_V = scaled_V.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < scaled_V.numel():
        kth = torch.topk(scaled_V, params.top_k).values[-1]
        scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled_V, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled_V = torch.full_like(scaled_V, float("-inf")).scatter(0, order, sorted_logits)
    return scaled_V


def nonfinite_logits() -> RequestError:
    """The answer to a request whose model gave NaN or infinite logits: finite garbage weights (a corrupt weights
    file, which the load's finiteness check passes) or a diverged model, named as such (was `500 internal error:
    RuntimeError`, or at temperature 0 a NaN's token sampled silently)."""
    return RequestError(
        "the model's logits are NaN or infinite: the served weights are broken (a corrupt weights file, or training "
        "diverged); /health names the weight step served",
        status_code=500,
    )


def sample(
    logits_V: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    mode: str,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    banned: Sequence[int] | torch.Tensor | None = None,
) -> tuple[int, torch.Tensor | None]:
    """One token id, and the log-prob vector that ``mode`` names when ``params`` asks for log-probs."""
    want = params.logprobs is not None
    raw = torch.log_softmax(logits_V, dim=-1) if want and mode == "raw" else None
    logits_V = process_logits(logits_V, params, prompt_ids, output_ids, banned)
    if params.temperature == 0:
        token = int(torch.argmax(logits_V))  # a NaN or +inf is the argmax: one picked is a model that gives them
        if not torch.isfinite(logits_V[token]):
            raise nonfinite_logits()
        return token, raw if raw is not None else (torch.log_softmax(logits_V, dim=-1) if want else None)
    final_V = truncate(logits_V / params.temperature, params)
    try:
        token = int(torch.multinomial(torch.softmax(final_V, dim=-1), 1, generator=generator))
    except RuntimeError:  # torch's "probability tensor contains either inf, nan or element < 0"
        if not bool((torch.isnan(logits_V) | torch.isposinf(logits_V)).any()):  # (-inf: banned tokens)
            raise
        raise nonfinite_logits() from None
    return token, raw if raw is not None else (torch.log_softmax(final_V, dim=-1) if want else None)


def sample_token(
    logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator, banned: list[int] | None = None
) -> int:
    """Sample one token id without log-probs (``banned`` ids get zero probability)."""
    return sample(logits_V, params, generator, "processed", banned=banned)[0]


def token_logprobs(logits_V: torch.Tensor, params: SamplingParams, mode: str) -> torch.Tensor:
    """Log-probs of unprocessed logits: raw, or scaled by the temperature (temperature 0 counts as 1)."""
    if mode == "processed" and params.temperature > 0:
        return torch.log_softmax(logits_V / params.temperature, dim=-1)
    return torch.log_softmax(logits_V, dim=-1)


@torch.inference_mode()
def prompt_logprobs(
    model: torch.nn.Module, prompt_ids: Sequence[int], k: int
) -> list[dict[int, tuple[float, int]] | None]:
    """vLLM's prompt log-probs, from one full forward of the prompt (the cached prefill keeps only the last
    position's logits); raw log-softmax, as vLLM computes them. Position 0 has none; position i holds
    {token: (log-prob, rank)} of its token, then of the top k alternatives."""
    device = next(model.parameters()).device
    out = model(torch.tensor([list(prompt_ids)], device=device))
    logits_SV = (out if isinstance(out, torch.Tensor) else out.logits)[0, :-1]
    targets = torch.tensor(list(prompt_ids[1:]), dtype=torch.long, device=logits_SV.device)
    entries: list[dict[int, tuple[float, int]] | None] = [None]
    # Positions in chunks: over the whole prompt at once, the fp32 copy, the log-softmax and the rank comparison were
    # three more prompt x vocabulary tensors (9 GB each for 16k positions of a 151k vocabulary).
    for start in range(0, len(targets), PROMPT_LOGPROBS_CHUNK):
        lps_CV = torch.log_softmax(logits_SV[start : start + PROMPT_LOGPROBS_CHUNK].float(), dim=-1)
        chunk = targets[start : start + PROMPT_LOGPROBS_CHUNK]
        token_lps = lps_CV.gather(1, chunk[:, None])[:, 0]
        ranks = (lps_CV > token_lps[:, None]).sum(-1) + 1
        top_v, top_i = torch.topk(lps_CV, k) if k > 0 else (None, None)
        for pos, (token, lp, rank) in enumerate(zip(chunk.tolist(), token_lps.tolist(), ranks.tolist(), strict=True)):
            entry = {token: (lp, rank)}
            if top_v is not None:
                for r, (t, v) in enumerate(zip(top_i[pos].tolist(), top_v[pos].tolist(), strict=True)):
                    entry.setdefault(t, (v, r + 1))
            entries.append(entry)
    return entries
