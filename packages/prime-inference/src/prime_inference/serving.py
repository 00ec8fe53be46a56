"""What every generation route shares: the served model's state (`ServerState`, ``app.state.prime``), request
checks, ``n`` fan-out into engine requests, and the bookkeeping of choices run to the end or streamed.

The server owns tokenization, chat templates, validation, ``n`` fan-out, stop-string truncation of text and
response formatting; an `Engine` only turns prompt token ids into sampled token ids and log-probs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse
from prime_core.config.inference import InferenceConfig

from prime_inference.engines.base import Engine, EngineOutput, EngineRequest
from prime_inference.protocol import RequestError, SamplingParams, error_body
from prime_inference.versions import VersionLedger, WeightGate

logger = logging.getLogger(__name__)


class FastJSONResponse(JSONResponse):
    """JSON bodies encoded by msgspec, about 10x faster than ``json.dumps`` on token and log-prob lists. That matters
    when hundreds of responses finish in the same engine step and are encoded one after another in the event loop."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


@dataclass
class Choice:
    """Accumulated output of one sequence, and how much of it a stream has sent."""

    index: int
    params: SamplingParams
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    def add(self, out: EngineOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            self.logprobs.extend(out.logprobs)
            self.top_logprobs.extend(out.top_logprobs or [{} for _ in out.token_ids])
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    def unsent(self) -> tuple[list[int], list[float], list[dict[int, float]]]:
        """Tokens (with log-probs) not streamed yet; marks them sent."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return self.token_ids[start:], self.logprobs[start:], self.top_logprobs[start:]


async def collect(
    engine: Engine, requests: list[EngineRequest], on_output: Callable[[EngineOutput], None] | None = None
) -> list[Choice]:
    """Run every request to the end; ``on_output`` sees each engine output as it comes."""
    choices = [Choice(i, r.params, r.prompt_ids) for i, r in enumerate(requests)]
    for r in requests:
        r.stream = False

    async def run(choice: Choice, request: EngineRequest) -> None:
        async for out in engine.generate(request):
            choice.add(out)
            if on_output is not None:
                on_output(out)

    tasks = [asyncio.ensure_future(run(c, r)) for c, r in zip(choices, requests, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return choices


async def stream(
    engine: Engine, requests: list[EngineRequest], on_output: Callable[[EngineOutput], None] | None = None
) -> AsyncIterator[tuple[Choice, bool]]:
    """Each engine delta as it comes, added to its choice: yields (choice, finished)."""
    choices = [Choice(i, r.params, r.prompt_ids) for i, r in enumerate(requests)]
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, request: EngineRequest) -> None:
        try:
            async for out in engine.generate(request):
                await queue.put((index, out))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(requests)]
    remaining, behind = len(tasks), False
    try:
        while remaining:
            batch = [await queue.get()]
            # A consumer that spent over a millisecond on its last delta gets every delta queued since at once: each
            # delta's view decodes (and parses) the whole text so far, so one view per token made a long stream
            # quadratic, in the event loop (a 40k-token answer held every other request for over ten minutes).
            while behind and not queue.empty():
                batch.append(queue.get_nowait())
            touched: dict[int, bool] = {}
            for index, out in batch:
                if isinstance(out, Exception):
                    raise out
                choices[index].add(out)
                if on_output is not None:
                    on_output(out)
                touched[index] = touched.get(index, False) or out.finish_reason is not None
            for index, finished in touched.items():
                remaining -= finished
                start = time.monotonic()
                yield choices[index], finished
                behind = time.monotonic() - start > 1e-3
    finally:
        for t in tasks:
            t.cancel()


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": None,
    }


def with_usage(chunk: dict[str, Any], req: Any, prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far."""
    if req.include_usage() and req.continuous_usage():
        chunk["usage"] = usage(prompt_tokens, choices)
    return chunk


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events ending in ``[DONE]``; an error after the headers went out is reported in-band, as vLLM."""

    def event(data: bytes) -> bytes:
        return b"data: " + data + b"\n\n"

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield event(msgspec.json.encode(chunk))
        except RequestError as e:
            yield event(msgspec.json.encode(error_body(e.message, e.status_code, e.param)))
        except Exception as e:
            logger.exception("stream failed")
            yield event(msgspec.json.encode(error_body(str(e), 500)))
        yield event(b"[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")


class BodyBudget:
    """Bytes of request bodies held at once, all requests together (``server.max_buffered_body_bytes``): each body
    counts from its first byte until it is parsed. One event loop takes and gives, so no lock."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, size: int) -> None:
        if self.held + size > self.limit:
            raise RequestError(
                f"the server already holds {self.held} bytes of request bodies being received; this one would pass "
                f"server.max_buffered_body_bytes = {self.limit}: retry later",
                status_code=503,
            )
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size


class ServerState:
    """The served model behind our own routes: engine, tokenizer and the checks every generation route makes."""

    def __init__(self, config: InferenceConfig, engine: Engine, tokenizer: Any):
        from prime_core.vision import VisionSpec

        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.model_name = config.served_model_name
        self.created = int(time.time())
        # A vision-language model's image preprocessing and special tokens (None for text models and hub ids).
        self.vision = VisionSpec.from_model_dir(config.model.name)
        self.parser = None
        if config.tool_parser or config.reasoning_parser:
            from prime_inference.chat_parsing import OutputParser

            self.parser = OutputParser(tokenizer, config.tool_parser, config.reasoning_parser)
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.versions = VersionLedger()
        self.body_budget = BodyBudget(config.server.max_buffered_body_bytes)
        self.weight_gate = WeightGate()
        # No token covers more characters than the longest entry of the vocabulary (byte-level BPE writes one
        # character per byte); twice that per token of context allows for normalizers that shrink the text (NFC).
        self.longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * engine.info.max_model_len * self.longest_token

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """``text``'s token ids; a text too long to fit the context is refused before the tokenizer sees it (it
        held the event loop for 9 s and took 1.6 GB on a 12 MB prompt)."""
        if len(text) > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {len(text)} characters, more than this model's maximum context length of "
                f"{self.engine.info.max_model_len} tokens can hold (a token is at most {self.longest_token} characters)",
                param=param,
            )
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def single_tokens(self, texts: tuple[str, ...]) -> dict[str, int]:
        """Those of ``texts`` that the tokenizer writes as one token, with its id."""
        ids = {t: self.tokenizer.encode(t, add_special_tokens=False) for t in texts}
        return {t: i[0] for t, i in ids.items() if len(i) == 1}

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter that the request's ``model`` names, or None for the base model."""
        if model is None or model == self.model_name or model == self.config.model.name:
            return None
        if model in self.engine.info.adapters:
            return model
        raise RequestError(f"The model `{model}` does not exist.", status_code=404, param="model")

    def check_tokens(self, ids: list[int], param: str) -> None:
        vocab = self.engine.info.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
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

    def check_params(self, params: SamplingParams) -> None:
        self.check_tokens(params.stop_token_ids, "stop_token_ids")
        self.check_tokens(list(params.logit_bias), "logit_bias")
        self.check_tokens(params.allowed_token_ids or [], "allowed_token_ids")
        if params.min_tokens > params.max_tokens:  # vLLM refuses it too (the torch engine ignored min_tokens then)
            raise RequestError(
                f"min_tokens must be less than or equal to max_tokens={params.max_tokens}, got {params.min_tokens}",
                param="min_tokens",
            )
        # Sets in effect (as vLLM reads them): a repeated id only made every token slower; 5M copies of one allowed
        # id (15 MB of JSON) held the whole batch for two minutes on 8 x 20 tokens.
        params.stop_token_ids = list(dict.fromkeys(params.stop_token_ids))
        if params.allowed_token_ids is not None:
            params.allowed_token_ids = list(dict.fromkeys(params.allowed_token_ids))
        if params.prompt_logprobs is not None and not self.engine.supports_prompt_logprobs:
            raise RequestError(
                f"prompt_logprobs is not supported by the {self.engine.name} engine", param="prompt_logprobs"
            )
        if params.grammar is not None:
            from prime_inference.structured import check_grammar

            check_grammar(self.tokenizer, params.grammar)

    def requests(
        self, prompt_ids: list[int], params: SamplingParams, n: int, first: int, adapter: str | None, multimodal=None
    ) -> list[EngineRequest]:
        """``n`` engine requests for one prompt; seeded requests get distinct, reproducible seeds per choice."""
        self.check_params(params)
        if params.prompt_logprobs is not None and (adapter is not None or multimodal is not None):
            raise RequestError("prompt_logprobs is served for text prompts on the base model", param="prompt_logprobs")
        out = []
        for i in range(n):
            p = dataclasses.replace(params)
            if p.seed is not None and n > 1:
                p.seed = p.seed + i
            request_id = f"{uuid.uuid4().hex}-{first + i}"
            out.append(EngineRequest(request_id, prompt_ids, p, multimodal=multimodal, lora_name=adapter))
        return out

    # ---- text ----

    def text(self, choice: Choice, final: bool) -> str:
        """Decoded text so far, cut at a stop string, without the stop token that ended it (vLLM); while
        streaming, holds back what may still become a stop string."""
        params = choice.params
        ids = choice.token_ids
        if final and ids and self.stopped_on_token(choice) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(choice.stop_reason, str):
            cut = text.find(choice.stop_reason)
            if cut >= 0:
                text = text[: cut + len(choice.stop_reason)] if params.include_stop_str_in_output else text[:cut]
        elif not final:
            if params.stop:
                text = text[: max(0, len(text) - max(len(s) for s in params.stop) + 1)]
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
        return text

    def stopped_on_token(self, choice: Choice) -> bool:
        """Ended by EOS or a stop token id (whose text vLLM leaves out), not by a stop string or a grammar."""
        if choice.finish_reason != "stop" or isinstance(choice.stop_reason, str):
            return False
        return isinstance(choice.stop_reason, int) or choice.token_ids[-1] in self.special_ids

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prompt_logprobs(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}}."""
        if choice.prompt_logprobs is None:
            return None
        return [
            None if entry is None else
            {str(t): {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": self.token_str(t)}
             for t, (lp, rank) in entry.items()}
            for entry in choice.prompt_logprobs
        ]  # fmt: skip
