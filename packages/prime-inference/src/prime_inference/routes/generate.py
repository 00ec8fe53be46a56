"""vLLM 0.26's token-in route, ``POST /inference/v1/generate`` (also ``/v1/generate``), on either engine: prompt
token ids in, completion token ids and log-probs out, through `Engine.generate` (the orchestrator's hot path)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from prime_inference.generate_logprobs import generate_logprobs
from prime_inference.protocol import GenerateRequest
from prime_inference.routes.common import parse_body, state
from prime_inference.serving import Choice, FastJSONResponse, ServerState, collect, sse, stream, usage
from prime_inference.structured import request_grammar

router = APIRouter()
GENERATE_ROUTES = ("/inference/v1/generate", "/v1/generate")


def _requests(s: ServerState, req: GenerateRequest) -> list:
    adapter = s.adapter(req.model)
    s.check_tokens(req.token_ids, "token_ids")
    multimodal = None
    if req.images:
        from prime_inference.multimodal import check_placeholders, decode_images

        multimodal = decode_images(req.images, s.vision, "images")
        check_placeholders(list(req.token_ids), multimodal, s.vision, "images")
    sp = req.sampling_params
    # vLLM: an omitted max_tokens means "up to max_model_len", not SamplingParams' default of 16.
    requested = sp.max_tokens if "max_tokens" in sp.model_fields_set else None
    params = req.sampling(s.max_tokens(len(req.token_ids), requested))
    params.grammar = request_grammar(sp.structured_outputs)
    return s.requests(list(req.token_ids), params, sp.n, 0, adapter, multimodal)


@router.post(GENERATE_ROUTES[0])
@router.post(GENERATE_ROUTES[1])
async def generate(request: Request) -> Any:
    s = state(request)
    req = await parse_body(request, GenerateRequest)
    requests = _requests(s, req)
    rid = f"generate-tokens-{req.request_id or uuid.uuid4().hex}"
    k = req.sampling_params.logprobs
    if req.stream:
        return sse(_chunks(s, req, requests, rid))
    choices = await collect(s.engine, requests)
    body = {
        "request_id": rid,
        "model": s.adapter(req.model) or s.model_name,
        "created": int(time.time()),
        "choices": [
            {
                "index": c.index,
                "finish_reason": c.finish_reason or "stop",
                "token_ids": c.token_ids,
                "logprobs": generate_logprobs(c.token_ids, c.logprobs, c.top_logprobs, k) if k is not None else None,
                "routed_experts": None,
            }  # fmt: skip
            for c in choices
        ],
        "usage": usage(len(req.token_ids), choices),
        "prompt_logprobs": s.prompt_logprobs(choices[0]),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "prompt_token_ids": list(req.token_ids),
    }
    return FastJSONResponse(body)


async def _chunks(s: ServerState, req: GenerateRequest, requests: list, rid: str) -> AsyncIterator[dict[str, Any]]:
    k = req.sampling_params.logprobs
    live: dict[int, Choice] = {}
    async for c, final in stream(s.engine, requests):
        live[c.index] = c
        ids, lps, tops = c.unsent()
        logprobs = generate_logprobs(ids, lps, tops, k) if k is not None else None
        yield {"request_id": rid, "choices": [{"index": c.index, "logprobs": logprobs, "token_ids": ids,
               "finish_reason": c.finish_reason if final else None, "routed_experts": None}]}  # fmt: skip
    if req.stream_options and req.stream_options.get("include_usage"):
        yield {"request_id": rid, "choices": [], "usage": usage(len(req.token_ids), list(live.values()))}
