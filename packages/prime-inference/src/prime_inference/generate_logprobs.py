"""Log-probs in the body of vLLM's token-in ``/inference/v1/generate`` response, built for speed.

The format is vLLM 0.26's: ``{"content": [{"token": "token_id:<id>", "logprob", "bytes": null, "top_logprobs":
[sampled token, then the top k]}]}``. An RL rollout asks for the sampled tokens' log-probs alone and hundreds of
responses finish in the same engine step, so a whole batch's tokens are formatted one after another on the event
loop: msgspec structs build about 3x and encode about 4x faster than one dict per entry (measured on 262,144 tokens).
"""

from __future__ import annotations

import msgspec

LOGPROB_FLOOR = -9999.0
"""-inf is not JSON: vLLM's OpenAI server clamps log-probs to this value."""


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: None = None


class PositionLogprobs(msgspec.Struct):
    token: str
    logprob: float
    bytes: None
    top_logprobs: list[TokenLogprob]


class GenerateLogprobs(msgspec.Struct):
    content: list[PositionLogprobs]


def generate_logprobs(
    token_ids: list[int], logprobs: list[float], top: list[dict[int, float]], k: int
) -> GenerateLogprobs:
    """The ``logprobs`` member of one choice. Each ``top_logprobs`` holds max(k, 1) entries: the sampled token, then
    the best alternatives (none up to k = 1, whatever ``top`` holds)."""
    names = [f"token_id:{t}" for t in token_ids]
    floor = LOGPROB_FLOOR
    values = [floor if lp < floor else lp for lp in logprobs]  # NaN stays NaN, as with max(lp, floor)
    if k <= 1:
        pairs = zip(names, values, strict=True)
        return GenerateLogprobs([PositionLogprobs(n, v, None, [TokenLogprob(n, v)]) for n, v in pairs])
    content = []
    for tid, name, value, alternatives in zip(token_ids, names, values, top, strict=True):
        ranked = [TokenLogprob(name, value)]
        for t, v in alternatives.items():
            if t != tid and len(ranked) < k:
                ranked.append(TokenLogprob(f"token_id:{t}", floor if v < floor else v))
        content.append(PositionLogprobs(name, value, None, ranked))
    return GenerateLogprobs(content)
