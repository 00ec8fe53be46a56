"""OpenAI routes on our engines: chat completions, completions, models, tokenize/detokenize, version and ping."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

import prime_inference
from prime_inference.chat_protocol import ChatCompletionRequest
from prime_inference.completions_serving import completion
from prime_inference.openai_serving import chat, chat_prompt
from prime_inference.protocol import CompletionRequest, RequestError, _Strict
from prime_inference.routes.common import parse_body, read_json, state, validate

router = APIRouter()


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``/tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's ``/tokenize`` with chat messages (rendered by the chat template)."""

    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    return await chat(state(request), await parse_body(request, ChatCompletionRequest))


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await completion(state(request), await parse_body(request, CompletionRequest))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    s = state(request)
    info = s.engine.info
    card = {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "prime",
            "root": s.config.model.name, "parent": None, "max_model_len": info.max_model_len,
            "weight_step": info.weight_step}  # fmt: skip
    adapters = [
        {**card, "id": name, "root": a["path"], "parent": s.model_name, "weight_step": a["weight_step"]}
        for name, a in info.adapters.items()
    ]
    return {"object": "list", "data": [card, *adapters]}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    s = state(request)
    data = await read_json(request)
    body = validate(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
    s.adapter(body.model)
    if isinstance(body, TokenizeChatRequest):
        ids = chat_prompt(s, body)
    else:
        ids = s.encode(body.prompt, body.add_special_tokens, "prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": s.engine.info.max_model_len, "tokens": ids,
                           "token_strs": None}  # fmt: skip
    if body.return_token_strs:
        out["token_strs"] = s.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    s = state(request)
    body = await parse_body(request, DetokenizeRequest)
    s.adapter(body.model)
    max_len = s.engine.info.max_model_len
    if len(body.tokens) > max_len:  # 5M tokens held the event loop, every client's answers, 4.4 s
        raise RequestError(
            f"tokens holds {len(body.tokens)} tokens, more than this model's maximum context length of {max_len}",
            param="tokens",
        )
    s.check_tokens(body.tokens, "tokens")
    return {"prompt": s.tokenizer.decode(body.tokens)}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": prime_inference.__version__}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping() -> Response:
    return Response(status_code=200)
