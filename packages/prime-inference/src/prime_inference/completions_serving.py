"""OpenAI completions on our engines (the torch engine; vLLM serves its own), with vLLM 0.26's log-probs and echo:
each token's ``top_logprobs`` hold the token itself and then the top k by rank (at most k + 1 entries, as OpenAI's
API defines), echoed prompt positions likewise from the prompt's log-probs, and ``echo`` with ``max_tokens: 0``
returns the prompt alone."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from prime_inference.protocol import CompletionRequest
from prime_inference.serving import Choice, FastJSONResponse, ServerState, collect, sse, stream, usage, with_usage
from prime_inference.structured import request_grammar


def token_entries(token: int, lp: float, top: dict[int, float]) -> dict[int, float]:
    """vLLM's per-token log-prob entries: the token first, then the top k by rank (the token once)."""
    return {token: lp, **{t: v for t, v in top.items() if t != token}}


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets, pos = [], start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return offsets


def completion_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list[dict[int, float]],
                        offset: int) -> dict[str, Any]:  # fmt: skip
    tokens = [state.token_str(t) for t in ids]
    top = [{state.token_str(t): max(v, -9999.0) for t, v in token_entries(tid, lp, d).items()}
           for tid, lp, d in zip(ids, lps, tops, strict=True)]  # fmt: skip
    return {"tokens": tokens, "token_logprobs": [max(v, -9999.0) for v in lps], "top_logprobs": top,
            "text_offset": _offsets(tokens, offset)}  # fmt: skip


def echo_logprobs(state: ServerState, choice: Choice, completion: dict[str, Any] | None) -> dict[str, Any]:
    """The echoed prompt's log-probs (its first token has none), then ``completion``'s, as vLLM's echo."""
    entries = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
    tokens = [state.token_str(t) for t in choice.prompt_ids]
    lps = [None if e is None else max(e[t][0], -9999.0) for t, e in zip(choice.prompt_ids, entries, strict=True)]
    top = [None if e is None else {state.token_str(t): max(lp, -9999.0) for t, (lp, _) in e.items()}
           for e in entries]  # fmt: skip
    prompt = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": _offsets(tokens, 0)}
    if completion is None:
        return prompt
    end = sum(len(t) for t in tokens)
    return {
        "tokens": tokens + completion["tokens"],
        "token_logprobs": lps + completion["token_logprobs"],
        "top_logprobs": top + completion["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + end for o in completion["text_offset"]],
    }


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids, with its text when it came as text (echo returns it as given)."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    out = []
    special = req.add_special_tokens is not False
    for item in prompts:
        ids = state.encode(item, special, "prompt") if isinstance(item, str) else item
        state.check_tokens(ids, "prompt")
        out.append((list(ids), item if isinstance(item, str) else None))
    return out


def _echo_only(req: CompletionRequest) -> bool:
    """vLLM: ``echo`` with ``max_tokens: 0`` generates one token and returns the prompt alone."""
    return req.echo and req.max_tokens == 0


async def completion(state: ServerState, req: CompletionRequest) -> Any:
    adapter = state.adapter(req.model)
    prompts = completion_prompts(state, req)
    grammar = request_grammar(req.structured_outputs, req.response_format)
    requested = 1 if _echo_only(req) else (16 if req.max_tokens is None else req.max_tokens)
    requests, echoes = [], []
    for ids, text in prompts:
        params = req.sampling(state.max_tokens(len(ids), requested), req.logprobs)
        params.grammar = grammar
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs  # vLLM: echoed prompt tokens carry their log-probs
        requests += state.requests(ids, params, req.n, len(requests), adapter)
        echo = (text if text is not None else state.tokenizer.decode(ids)) if req.echo else ""
        echoes += [echo] * req.n
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": adapter or state.model_name}
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    if req.stream:
        return sse(completion_chunks(state, req, requests, prompt_tokens, base, echoes))
    choices = await collect(state.engine, requests)
    return FastJSONResponse({**base, "object": "text_completion", "choices": [_choice(state, req, c, echoes[c.index])
                             for c in choices], "usage": usage(prompt_tokens, choices)})  # fmt: skip


def _choice(state: ServerState, req: CompletionRequest, c: Choice, echo: str) -> dict[str, Any]:
    generated = not _echo_only(req)
    item: dict[str, Any] = {"index": c.index, "text": echo + (state.text(c, final=True) if generated else ""),
                            "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
    if req.logprobs is not None:
        lps = completion_logprobs(state, c.token_ids, c.logprobs, c.top_logprobs, 0) if generated else None
        item["logprobs"] = echo_logprobs(state, c, lps) if req.echo else lps
    item["prompt_logprobs"] = state.prompt_logprobs(c)
    if req.return_token_ids:
        item["prompt_token_ids"] = c.prompt_ids
        item["token_ids"] = c.token_ids
    return item


async def completion_chunks(
    state: ServerState, req: CompletionRequest, requests: list, prompt_tokens: int, base: dict, echoes: list[str]
) -> AsyncIterator[dict[str, Any]]:
    chunk = {**base, "object": "text_completion"}
    live: dict[int, Choice] = {}
    echoed: set[int] = set()
    generated = not _echo_only(req)
    async for c, final in stream(state.engine, requests):
        live[c.index] = c
        text = state.text(c, final) if generated else ""
        delta, start = text[c.sent_text :], c.sent_text
        c.sent_text = max(c.sent_text, len(text))
        first = c.index not in echoed
        if first:
            delta = echoes[c.index] + delta
        ids, lps, tops = c.unsent() if generated else ([], [], [])
        logprobs = None
        if req.logprobs is not None and (ids or (req.echo and first)):
            logprobs = completion_logprobs(state, ids, lps, tops, start) if ids else None
            if req.echo and first:
                logprobs = echo_logprobs(state, c, logprobs)
        if not delta and not final and logprobs is None:
            continue
        echoed.add(c.index)
        item: dict[str, Any] = {"index": c.index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason if final else None}  # fmt: skip
        if req.return_token_ids:
            item["token_ids"] = ids
        yield with_usage({**chunk, "choices": [item]}, req, prompt_tokens, list(live.values()))
    if req.include_usage():
        yield {**chunk, "choices": [], "usage": usage(prompt_tokens, list(live.values()))}
