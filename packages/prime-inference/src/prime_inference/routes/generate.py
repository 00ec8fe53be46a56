"""vLLM 0.26's token-in route, ``POST /inference/v1/generate`` (also ``/v1/generate``), on either engine: prompt
token ids in, completion token ids and log-probs out, through `Engine.generate` (the orchestrator's hot path). A request tagged with its
rollout records the weight steps of its tokens in the server's version ledger (`prime_inference.versions`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from prime_inference.engines.base import EngineOutput
from prime_inference.generate_logprobs import generate_logprobs
from prime_inference.protocol import GenerateRequest, RequestError
from prime_inference.routes.common import parse_body, state
from prime_inference.serving import Choice, FastJSONResponse, ServerState, collect, sse, stream, usage
from prime_inference.structured import request_grammar
from prime_inference.versions import min_weight_step, rollout_tag

router = APIRouter()
GENERATE_ROUTES = ("/inference/v1/generate", "/v1/generate")


async def _prompt(s: ServerState, req: GenerateRequest) -> tuple[list[int], Any, dict[str, Any] | None]:
    """The prompt the engine runs, its images, and vLLM's ``mm_placeholders`` when the images came as
    ``content_parts`` (renderers' token-in with one placeholder token per image, expanded here as vLLM does)."""
    from prime_inference.multimodal import (
        check_placeholders,
        content_part_images,
        decode_images_off_loop,
        placeholder_ranges,
    )

    ids = list(req.token_ids)
    s.check_tokens(ids, "token_ids")
    if req.images:
        multimodal = await decode_images_off_loop(req.images, s.vision, "images")
        check_placeholders(ids, multimodal, s.vision, "images")
        return ids, multimodal, None
    sources = content_part_images(req.content_parts or [], "content_parts")
    if not sources:
        return ids, None, None
    multimodal = await decode_images_off_loop(sources, s.vision, "content_parts")
    try:
        ids = s.vision.expand_placeholders(ids, multimodal.image_grid_thw)
    except ValueError as e:
        raise RequestError(str(e), param="content_parts") from e
    return ids, multimodal, {"image": placeholder_ranges(ids, s.vision.image_token_id)}


def _requests(s: ServerState, req: GenerateRequest, prompt: list[int], multimodal: Any) -> list:
    sp = req.sampling_params
    # vLLM: an omitted max_tokens means "up to max_model_len", not SamplingParams' default of 16.
    requested = sp.max_tokens if "max_tokens" in sp.model_fields_set else None
    params = req.sampling(s.max_tokens(len(prompt), requested))
    params.grammar = request_grammar(sp.structured_outputs)
    params.structured_outputs = sp.structured_outputs if params.grammar is not None else None
    return s.requests(prompt, params, sp.n, 0, s.adapter(req.model), multimodal)


@router.post(GENERATE_ROUTES[0])
@router.post(GENERATE_ROUTES[1])
async def generate(request: Request) -> Any:
    s = state(request)
    req = await parse_body(request, GenerateRequest)
    prompt, multimodal, placeholders = await _prompt(s, req)
    requests = _requests(s, req, prompt, multimodal)
    rid = f"generate-tokens-{req.request_id or uuid.uuid4().hex}"
    k = req.sampling_params.logprobs
    tag = rollout_tag(req.sampling_params.extra_args)
    for engine_request in requests:
        engine_request.session = tag
    oldest = min_weight_step(req.sampling_params.extra_args)
    await s.weight_gate.wait(s.engine, oldest, s.config.server.weight_wait_timeout)
    on_output = _recorder(s, tag)
    if req.stream:
        return sse(_chunks(s, req, requests, rid, len(prompt), on_output))
    choices = await s.versions.run(tag, collect(s.engine, requests, on_output))
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
        "usage": usage(len(prompt), choices),
        "prompt_logprobs": s.prompt_logprobs(choices[0]),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "prompt_token_ids": prompt,
    }
    if placeholders is not None:
        body["mm_placeholders"] = placeholders
    return FastJSONResponse(body)


def _recorder(s: ServerState, tag: str | None) -> Callable[[EngineOutput], None] | None:
    """What records a tagged request's weight steps in the server's version ledger (`prime_inference.versions`)."""
    if tag is None:
        return None
    if not s.engine.live_versions:
        s.versions.begin(tag, s.engine.info.weight_step)
    return lambda out: s.versions.record(tag, out)


async def _chunks(
    s: ServerState,
    req: GenerateRequest,
    requests: list,
    rid: str,
    prompt_len: int,
    on_output: Callable[[EngineOutput], None] | None,
) -> AsyncIterator[dict[str, Any]]:
    k = req.sampling_params.logprobs
    live: dict[int, Choice] = {}
    async for c, final in stream(s.engine, requests, on_output):
        live[c.index] = c
        ids, lps, tops = c.unsent()
        logprobs = generate_logprobs(ids, lps, tops, k) if k is not None else None
        yield {"request_id": rid, "choices": [{"index": c.index, "logprobs": logprobs, "token_ids": ids,
               "finish_reason": c.finish_reason if final else None, "routed_experts": None}]}  # fmt: skip
    if req.stream_options and req.stream_options.get("include_usage"):
        yield {"request_id": rid, "choices": [], "usage": usage(prompt_len, list(live.values()))}
