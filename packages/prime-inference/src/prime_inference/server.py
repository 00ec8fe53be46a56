"""The HTTP surface shared by both engines: OpenAI routes, vLLM's token-in generate route and the admin routes.

The server owns tokenization, chat templates, validation, ``n`` fan-out, stop-string truncation of text and
response formatting; an `Engine` only turns prompt token ids into sampled token ids and log-probs. Every bad input
is answered with a 4xx and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prime_core.config.inference import InferenceConfig
from prime_core.schemas.adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, is_adapter_dir
from prime_core.schemas.weights import WeightUpdateRequest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from prime_inference import adapters
from prime_inference.broadcast import BroadcastError
from prime_inference.engines.base import Engine, EngineOutput, EngineRequest
from prime_inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    SamplingParams,
    error_body,
)
from prime_inference.weights import check_weight_dir

if TYPE_CHECKING:
    from prime_inference.multimodal import MultiModalInput

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
GENERATE_ROUTES = ("/inference/v1/generate", "/v1/generate")


class FastJSONResponse(JSONResponse):
    """JSON bodies encoded by msgspec, about 10x faster than ``json.dumps`` on token and log-prob lists. That matters
    when hundreds of responses finish in the same engine step and are encoded one after another in the event loop."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def _error(message: str, status_code: int, param: str | None = None) -> JSONResponse:
    return FastJSONResponse(error_body(message, status_code, param), status_code=status_code)


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e["loc"] if x not in ("body",))
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(f"request body larger than {MAX_BODY_BYTES} bytes", status_code=413)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"request body larger than {MAX_BODY_BYTES} bytes", status_code=413)
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestError(_validation_message(e)) from e


@dataclass
class _Choice:
    """Accumulated output of one sequence."""

    index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0

    def add(self, out: EngineOutput) -> None:
        self.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            self.logprobs.extend(out.logprobs)
            self.top_logprobs.extend(out.top_logprobs or [{} for _ in out.token_ids])
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Server:
    def __init__(self, config: InferenceConfig, engine: Engine, tokenizer: Any):
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.model_name = config.served_model_name
        self.created = int(time.time())
        from prime_core.vision import VisionSpec

        # A vision-language model's image preprocessing and special tokens (None for text models and hub ids).
        self.vision = VisionSpec.from_model_dir(config.model.name)

    # ---- helpers ----

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter that the request's ``model`` names, or None for the base model."""
        if model is None or model == self.model_name or model == self.config.model.name:
            return None
        if model in self.engine.info.adapters:
            return model
        raise RequestError(f"The model `{model}` does not exist.", status_code=404, param="model")

    @staticmethod
    def _use_adapter(requests: list[EngineRequest], adapter: str | None) -> None:
        for r in requests:
            r.lora_name = adapter

    def _check_tokens(self, ids: list[int], param: str) -> None:
        vocab = self.engine.info.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        max_len = self.engine.info.max_model_len
        if prompt_len == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if prompt_len >= max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                param="max_tokens",
            )
        if requested is None:
            return max_len - prompt_len
        if requested < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if prompt_len + requested > max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        return requested

    def _check_params(self, params: SamplingParams) -> None:
        self._check_tokens(params.stop_token_ids, "stop_token_ids")

    def _requests(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        first: int,
        multimodal: MultiModalInput | None = None,
    ) -> list[EngineRequest]:
        reqs = []
        for i in range(n):
            p = SamplingParams(**vars(params))
            if p.seed is not None and n > 1:
                p.seed = p.seed + i  # distinct but reproducible samples per choice
            reqs.append(EngineRequest(f"{uuid.uuid4().hex}-{first + i}", prompt_ids, p, multimodal=multimodal))
        return reqs

    async def _run_all(self, requests: list[EngineRequest]) -> list[_Choice]:
        choices = [_Choice(i, r.params) for i, r in enumerate(requests)]
        for r in requests:
            r.stream = False

        async def run(choice: _Choice, request: EngineRequest) -> None:
            async for out in self.engine.generate(request):
                choice.add(out)

        tasks = [asyncio.ensure_future(run(c, r)) for c, r in zip(choices, requests, strict=True)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return choices

    async def _stream_all(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, EngineOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, request: EngineRequest) -> None:
            try:
                async for out in self.engine.generate(request):
                    await queue.put((index, out))
            except Exception as e:
                await queue.put((index, e))

        tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(requests)]
        remaining = len(tasks)
        try:
            while remaining:
                index, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finish_reason is not None:
                    remaining -= 1
                yield index, out
        finally:
            for t in tasks:
                t.cancel()

    def _text(self, choice: _Choice, final: bool) -> str:
        """Decoded text so far, cut at a stop string; while streaming, holds back what may still become one."""
        text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        stops = choice.params.stop
        if isinstance(choice.stop_reason, str):
            cut = text.find(choice.stop_reason)
            if cut >= 0:
                text = text[: cut + len(choice.stop_reason)] if choice.params.include_stop_str_in_output else text[:cut]
        elif not final:
            if stops:
                text = text[: max(0, len(text) - max(len(s) for s in stops) + 1)]
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
        return text

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict[str, Any]:
        content = []
        for tid, lp, top in zip(ids, lps, tops, strict=True):
            tok = self._token_str(tid)
            content.append(
                {
                    "token": tok,
                    "logprob": max(lp, -9999.0),
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": (t := self._token_str(k)), "logprob": max(v, -9999.0), "bytes": list(t.encode())}
                        for k, v in top.items()
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(
        self, ids: list[int], lps: list[float], tops: list[dict[int, float]], offset: int, k: int
    ) -> dict[str, Any]:
        tokens = [self._token_str(t) for t in ids]
        offsets, pos = [], offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top = [{self._token_str(t): v for t, v in d.items()} for d in tops] if k > 0 else None
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    @staticmethod
    def _generate_logprobs(ids: list[int], lps: list[float], tops: list[dict[int, float]], k: int) -> dict[str, Any]:
        """vLLM's token-in format: tokens as ``token_id:<id>``; top list = sampled token then the top k."""
        if k <= 0:
            # Only the sampled token: its entry doubles as the one-element top list (shared, encoded twice).
            entries = [
                {"token": f"token_id:{tid}", "logprob": max(lp, -9999.0), "bytes": None}
                for tid, lp in zip(ids, lps, strict=True)
            ]
            return {"content": [{**e, "top_logprobs": [e]} for e in entries]}
        content = []
        for tid, lp, top in zip(ids, lps, tops, strict=True):
            ranked = {tid: lp, **{t: v for t, v in top.items() if t != tid}}
            content.append(
                {
                    "token": f"token_id:{tid}",
                    "logprob": max(lp, -9999.0),
                    "bytes": None,
                    "top_logprobs": [
                        {"token": f"token_id:{t}", "logprob": max(v, -9999.0), "bytes": None}
                        for t, v in list(ranked.items())[: max(k, 1)]
                    ],
                }
            )
        return {"content": content}

    @staticmethod
    def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": None,
        }

    def _headers(self) -> dict[str, str]:
        return {"X-Weight-Step": str(self.engine.info.weight_step)}

    # ---- chat ----

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("the served model's tokenizer has no chat template; use /v1/completions")
        messages = [m.template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # jinja errors (raise_exception in templates), bad kwargs
            raise RequestError(f"chat template failed: {e}", param="messages") from e
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_images(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> tuple[list[int], Any]:
        """Decode the messages' image parts and expand each rendered placeholder to the image's token run."""
        urls = [u for m in req.messages for u in m.image_urls()]
        if not urls:
            return prompt_ids, None
        from prime_inference.multimodal import decode_images

        multimodal = decode_images(urls, self.vision, "messages")
        try:
            prompt_ids = self.vision.expand_placeholders(prompt_ids, multimodal.image_grid_thw)
        except ValueError as e:
            raise RequestError(f"{e} (does the chat template render image parts?)", param="messages") from e
        return prompt_ids, multimodal

    async def chat(self, request: Request) -> Any:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        adapter = self._check_model(req.model)
        prompt_ids = self._chat_prompt(req)
        prompt_ids, multimodal = self._chat_images(req, prompt_ids)
        max_tokens = self._max_tokens(len(prompt_ids), req.requested_max_tokens())
        params = req.sampling(max_tokens, req.requested_logprobs())
        self._check_params(params)
        requests = self._requests(prompt_ids, params, req.n, 0, multimodal)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": adapter or self.model_name}
        self._use_adapter(requests, adapter)
        if req.stream:
            return self._sse(self._chat_stream(req, requests, prompt_ids, base))
        choices = await self._run_all(requests)
        out = []
        for c in choices:
            item: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": self._text(c, final=True), "tool_calls": []},
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                item["token_ids"] = c.token_ids
            out.append(item)
        body = {**base, "object": "chat.completion", "choices": out, "usage": self._usage(len(prompt_ids), choices)}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return FastJSONResponse(body, headers=self._headers())

    async def _chat_stream(
        self, req: ChatCompletionRequest, requests: list[EngineRequest], prompt_ids: list[int], base: dict
    ) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice(i, r.params) for i, r in enumerate(requests)]
        chunk = {**base, "object": "chat.completion.chunk"}
        for c in choices:
            yield {**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}  # fmt: skip
        async for index, out in self._stream_all(requests):
            c = choices[index]
            c.add(out)
            final = out.finish_reason is not None
            text = self._text(c, final)
            delta_text, c.sent_text = text[c.sent_text :], max(c.sent_text, len(text))
            new_ids = c.token_ids[c.sent_tokens :]
            logprobs = None
            if req.logprobs and new_ids:
                logprobs = self._chat_logprobs(new_ids, c.logprobs[c.sent_tokens :], c.top_logprobs[c.sent_tokens :])
            c.sent_tokens = len(c.token_ids)
            if not delta_text and not final and logprobs is None:
                continue
            delta: dict[str, Any] = {"content": delta_text}
            if req.return_token_ids:
                delta["token_ids"] = new_ids
            yield {**chunk, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": out.finish_reason,
                                         "stop_reason": out.stop_reason if final else None}]}  # fmt: skip
        if req.include_usage():
            yield {**chunk, "choices": [], "usage": self._usage(len(prompt_ids), choices)}

    # ---- completions ----

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        out = []
        for item in prompts:
            ids = list(self.tokenizer(item)["input_ids"]) if isinstance(item, str) else list(item)
            self._check_tokens(ids, "prompt")
            out.append(ids)
        return out

    async def completion(self, request: Request) -> Any:
        req: CompletionRequest = await _parse(request, CompletionRequest)
        adapter = self._check_model(req.model)
        prompts = self._completion_prompts(req)
        requests: list[EngineRequest] = []
        for ids in prompts:
            max_tokens = self._max_tokens(len(ids), 16 if req.max_tokens is None else req.max_tokens)
            params = req.sampling(max_tokens, req.logprobs)
            self._check_params(params)
            requests += self._requests(ids, params, req.n, len(requests))
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": adapter or self.model_name}
        self._use_adapter(requests, adapter)
        prompt_tokens = sum(len(p) for p in prompts)
        if req.stream:
            return self._sse(self._completion_stream(req, requests, prompt_tokens, base))
        choices = await self._run_all(requests)
        out = []
        for c in choices:
            item: dict[str, Any] = {
                "index": c.index,
                "text": self._text(c, final=True),
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.logprobs is not None:
                item["logprobs"] = self._completion_logprobs(c.token_ids, c.logprobs, c.top_logprobs, 0, req.logprobs)
            if req.return_token_ids:
                item["prompt_token_ids"] = requests[c.index].prompt_ids
                item["token_ids"] = c.token_ids
            out.append(item)
        body = {**base, "object": "text_completion", "choices": out, "usage": self._usage(prompt_tokens, choices)}
        return FastJSONResponse(body, headers=self._headers())

    async def _completion_stream(
        self, req: CompletionRequest, requests: list[EngineRequest], prompt_tokens: int, base: dict
    ) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice(i, r.params) for i, r in enumerate(requests)]
        chunk = {**base, "object": "text_completion"}
        async for index, out in self._stream_all(requests):
            c = choices[index]
            c.add(out)
            final = out.finish_reason is not None
            text = self._text(c, final)
            delta_text, start = text[c.sent_text :], c.sent_text
            c.sent_text = max(c.sent_text, len(text))
            new_ids = c.token_ids[c.sent_tokens :]
            logprobs = None
            if req.logprobs is not None and new_ids:
                logprobs = self._completion_logprobs(
                    new_ids, c.logprobs[c.sent_tokens :], c.top_logprobs[c.sent_tokens :], start, req.logprobs
                )
            c.sent_tokens = len(c.token_ids)
            if not delta_text and not final and logprobs is None:
                continue
            item: dict[str, Any] = {"index": index, "text": delta_text, "logprobs": logprobs,
                                    "finish_reason": out.finish_reason,
                                    "stop_reason": out.stop_reason if final else None}  # fmt: skip
            if req.return_token_ids:
                item["token_ids"] = new_ids
            yield {**chunk, "choices": [item]}
        if req.include_usage():
            yield {**chunk, "choices": [], "usage": self._usage(prompt_tokens, choices)}

    # ---- token-in generate (vLLM 0.26 /inference/v1/generate) ----

    async def generate(self, request: Request) -> Any:
        req: GenerateRequest = await _parse(request, GenerateRequest)
        adapter = self._check_model(req.model)
        self._check_tokens(req.token_ids, "token_ids")
        multimodal = None
        if req.images:
            from prime_inference.multimodal import check_placeholders, decode_images

            multimodal = decode_images(req.images, self.vision, "images")
            check_placeholders(list(req.token_ids), multimodal, self.vision, "images")
        sp = req.sampling_params
        # vLLM: an omitted max_tokens means "up to max_model_len", not SamplingParams' default of 16.
        requested = sp.max_tokens if "max_tokens" in sp.model_fields_set else None
        max_tokens = self._max_tokens(len(req.token_ids), requested)
        params = req.sampling(max_tokens)
        self._check_params(params)
        requests = self._requests(list(req.token_ids), params, sp.n, 0, multimodal)
        rid = f"generate-tokens-{req.request_id or uuid.uuid4().hex}"
        k = sp.logprobs if sp.logprobs is not None else -1
        self._use_adapter(requests, adapter)
        if req.stream:
            return self._sse(self._generate_stream(req, requests, rid, k))
        choices = await self._run_all(requests)
        body = {
            "request_id": rid,
            "model": adapter or self.model_name,
            "created": int(time.time()),
            "choices": [
                {
                    "index": c.index,
                    "logprobs": self._generate_logprobs(c.token_ids, c.logprobs, c.top_logprobs, k)
                    if sp.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason or "stop",
                    "token_ids": c.token_ids,
                    "routed_experts": None,
                }
                for c in choices
            ],
            "usage": self._usage(len(req.token_ids), choices),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "prompt_token_ids": list(req.token_ids),
        }
        return FastJSONResponse(body, headers=self._headers())

    async def _generate_stream(
        self, req: GenerateRequest, requests: list[EngineRequest], rid: str, k: int
    ) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice(i, r.params) for i, r in enumerate(requests)]
        async for index, out in self._stream_all(requests):
            choices[index].add(out)
            logprobs = None
            if req.sampling_params.logprobs is not None:
                logprobs = self._generate_logprobs(out.token_ids, out.logprobs or [], out.top_logprobs or [], k)
            yield {"request_id": rid, "choices": [{"index": index, "logprobs": logprobs,
                   "finish_reason": out.finish_reason, "token_ids": out.token_ids, "routed_experts": None}]}  # fmt: skip
        if req.stream_options and req.stream_options.get("include_usage"):
            yield {"request_id": rid, "choices": [], "usage": self._usage(len(req.token_ids), choices)}

    def _sse(self, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        def event(data: bytes) -> bytes:
            return b"data: " + data + b"\n\n"

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield event(msgspec.json.encode(chunk))
            except Exception as e:  # headers are already sent: report in-band, as vLLM does
                logger.exception("stream failed")
                yield event(msgspec.json.encode(error_body(str(e), 500)))
            yield event(b"[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream", headers=self._headers())

    # ---- info and admin ----

    def models(self) -> dict[str, Any]:
        info = self.engine.info
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "prime",
            "root": self.config.model.name,
            "parent": None,
            "max_model_len": info.max_model_len,
            "weight_step": info.weight_step,
        }
        adapters = [
            {**card, "id": name, "root": a["path"], "parent": self.model_name, "weight_step": a["weight_step"]}
            for name, a in info.adapters.items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    def health(self) -> dict[str, Any]:
        info = self.engine.info
        return {
            "status": "ok",
            "engine": info.engine,
            "model": info.model,
            "weight_step": info.weight_step,
            "weight_dir": info.weight_dir,
            "paused": info.paused,
            "max_model_len": info.max_model_len,
            "adapters": info.adapters,
            **info.extra,
        }

    async def update_weights(self, request: Request) -> dict[str, Any]:
        req: WeightUpdateRequest = await _parse(request, WeightUpdateRequest)
        weight_path = adapters.confined_dir(req.weight_dir, self.config.server.weight_roots, "weight_dir")
        if is_adapter_dir(weight_path):
            return await self._update_adapter(weight_path, req.weight_dir, req.step)
        if req.step is not None and req.step < 0:
            raise RequestError("step must be >= 0", param="step")
        path, manifest = check_weight_dir(req.weight_dir, self.config.server.weight_roots, req.source)
        try:
            if manifest is not None:
                await self.engine.receive_weights(manifest, req.step)
            else:
                await self.engine.update_weights(str(path), req.step)
        except RequestError:
            raise
        except BroadcastError as e:
            raise RequestError(f"weight broadcast for {req.weight_dir} failed: {e}", status_code=504) from e
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise RequestError(f"failed to load weights from {req.weight_dir}: {e}", param="weight_dir") from e
        return {"status": "ok", "weight_step": self.engine.info.weight_step, "weight_dir": str(path)}

    async def _update_adapter(self, path: Any, weight_dir: str, step: int | None) -> dict[str, Any]:
        """``/update_weights`` with a trainer-published adapter: replace the adapter it names."""
        if step is not None and step < 0:
            raise RequestError("step must be >= 0", param="step")
        info = adapters.published_adapter(path, weight_dir)
        step = info.step if step is None else step
        await self._load_adapter(info.name, path, step, "weight_dir")
        return {"status": "ok", "lora_name": info.name, "weight_step": step, "weight_dir": str(path)}

    async def _load_adapter(self, name: str, path: Any, step: int | None, param: str) -> None:
        try:
            await self.engine.load_adapter(name, str(path), step)
        except RequestError:
            raise
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise RequestError(f"failed to load LoRA adapter {name!r} from {path}: {e}", param=param) from e

    async def load_lora_adapter(self, request: Request) -> dict[str, Any]:
        """vLLM's ``POST /v1/load_lora_adapter``; loading an existing name replaces that adapter."""
        req: LoadLoRAAdapterRequest = await _parse(request, LoadLoRAAdapterRequest)
        if req.lora_name in (self.model_name, self.config.model.name):
            raise RequestError("lora_name must differ from the base model's name", param="lora_name")
        path = adapters.check_adapter_dir(req.lora_path, self.config.server.weight_roots)
        await self._load_adapter(req.lora_name, path, req.step, "lora_path")
        return {"status": "ok", "lora_name": req.lora_name, "lora_path": str(path), "weight_step": req.step}

    async def unload_lora_adapter(self, request: Request) -> dict[str, Any]:
        req: UnloadLoRAAdapterRequest = await _parse(request, UnloadLoRAAdapterRequest)
        await self.engine.unload_adapter(req.lora_name)
        return {"status": "ok", "lora_name": req.lora_name}


def build_app(config: InferenceConfig, engine_factory: Callable[[], tuple[Engine, Any]]) -> FastAPI:
    """The FastAPI app. ``engine_factory`` builds (engine, tokenizer) at startup, inside the server's loop."""
    state: dict[str, Server] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine, tokenizer = await asyncio.to_thread(engine_factory)
        await engine.start()
        state["server"] = Server(config, engine, tokenizer)
        logger.info("serving %s with the %s engine", config.served_model_name, engine.name)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(
        title="prime inference",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=FastJSONResponse,
    )
    api_key = config.server.api_key

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return _error("missing or invalid API key (Authorization: Bearer <key>)", 401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return _error(exc.message, exc.status_code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return _error(f"internal error: {type(exc).__name__}", 500)

    def server() -> Server:
        return state["server"]

    async def chat(request: Request):
        return await server().chat(request)

    async def completion(request: Request):
        return await server().completion(request)

    async def generate(request: Request):
        return await server().generate(request)

    async def models():
        return server().models()

    async def health():
        return server().health()

    async def update_weights(request: Request):
        return await server().update_weights(request)

    async def load_lora_adapter(request: Request):
        return await server().load_lora_adapter(request)

    async def unload_lora_adapter(request: Request):
        return await server().unload_lora_adapter(request)

    async def reload_weights():
        await server().engine.reload_weights()
        return {"status": "ok", "weight_step": server().engine.info.weight_step}

    async def weight_transfer(op: str, request: Request):
        raw = await request.body()
        try:
            payload = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}") from e
        if not isinstance(payload, dict):
            raise RequestError("request body must be a JSON object")
        return await server().engine.weight_transfer(op, payload)

    async def pause():
        await server().engine.pause()
        return {"status": "paused"}

    async def resume():
        await server().engine.resume()
        return {"status": "resumed"}

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completion, methods=["POST"])
    for path in GENERATE_ROUTES:
        app.add_api_route(path, generate, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    # Admin routes answer at the root and under /v1 (prime-rl's admin base URL ends in /v1).
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/update_weights", update_weights, methods=["POST"])
        app.add_api_route(f"{prefix}/reload_weights", reload_weights, methods=["POST"])
        app.add_api_route(f"{prefix}/pause", pause, methods=["POST"])
        app.add_api_route(f"{prefix}/resume", resume, methods=["POST"])
        app.add_api_route(f"{prefix}/load_lora_adapter", load_lora_adapter, methods=["POST"])
        app.add_api_route(f"{prefix}/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
        app.add_api_route(f"{prefix}/weight_transfer/{{op}}", weight_transfer, methods=["POST"])
    return app
