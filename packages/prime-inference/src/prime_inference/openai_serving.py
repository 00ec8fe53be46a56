"""OpenAI chat completions and completions on our engines (the torch engine; vLLM serves its own): prompts from
the chat template, vLLM's tool-call, reasoning and structured-output behaviour, responses and stream chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prime_inference.chat_parsing import forced_tool_calls
from prime_inference.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from prime_inference.serving import Choice, FastJSONResponse, ServerState, collect, sse, stream, usage
from prime_inference.structured import request_grammar


def _lp(value: float) -> float:
    return max(value, -9999.0)


def chat_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list[dict[int, float]]) -> dict:
    content = []
    for tid, lp, top in zip(ids, lps, tops, strict=True):
        tok = state.token_str(tid)
        alternatives = [{"token": (t := state.token_str(k)), "logprob": _lp(v), "bytes": list(t.encode())}
                        for k, v in top.items()]  # fmt: skip
        content.append({"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode()), "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list[dict[int, float]],
                        offset: int, k: int) -> dict[str, Any]:  # fmt: skip
    tokens = [state.token_str(t) for t in ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [{state.token_str(t): v for t, v in d.items()} for d in tops] if k > 0 else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(state: ServerState, choice: Choice, k: int, completion: dict[str, Any]) -> dict[str, Any]:
    """``completion``'s log-probs after those of the echoed prompt (its first token has none), as vLLM's echo."""
    entries = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
    tokens = [state.token_str(t) for t in choice.prompt_ids]
    lps = [None if e is None else e[t][0] for t, e in zip(choice.prompt_ids, entries, strict=True)]
    top = [None if e is None else {state.token_str(t): lp for t, (lp, rank) in e.items() if rank <= k}
           for e in entries]  # fmt: skip
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens + completion["tokens"],
        "token_logprobs": lps + completion["token_logprobs"],
        "top_logprobs": top + completion["top_logprobs"] if completion["top_logprobs"] is not None else None,
        "text_offset": offsets + [o + pos for o in completion["text_offset"]],
    }


# ---- chat ----


def tool_choice(state: ServerState, req: ChatCompletionRequest) -> str | dict | None:
    """vLLM's rules: tools without a tool_choice mean "auto"; any tool_choice but "none" needs a tool-call parser."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else None)
    if req.tools and choice not in (None, "none") and state.config.tool_call_parser is None:
        if choice == "auto":
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        else:
            named = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
            message = f"tool_choice={named} requires --tool-call-parser to be set"
        raise RequestError(message, param="tool_choice")
    return choice


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise RequestError("the served model's tokenizer has no chat template; use /v1/completions")
    messages = [m.template_dict() for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    try:
        text = state.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
    except Exception as e:  # jinja errors (raise_exception in templates), bad kwargs
        raise RequestError(f"chat template failed: {e}", param="messages") from e
    return list(state.tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_images(state: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]) -> tuple[list[int], Any]:
    """Decode the messages' image parts and expand each rendered placeholder to the image's token run."""
    urls = [u for m in req.messages for u in m.image_urls()]
    if not urls:
        return prompt_ids, None
    from prime_inference.multimodal import decode_images

    multimodal = decode_images(urls, state.vision, "messages")
    try:
        prompt_ids = state.vision.expand_placeholders(prompt_ids, multimodal.image_grid_thw)
    except ValueError as e:
        raise RequestError(f"{e} (does the chat template render image parts?)", param="messages") from e
    return prompt_ids, multimodal


@dataclass
class ChatView:
    """What a choice says so far: reasoning, content and tool calls, and the finish reason to report."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


def chat_view(state: ServerState, req: ChatCompletionRequest, choice: Choice, choice_of_tool: Any, final: bool):
    text = state.text(choice, final)
    finish = choice.finish_reason
    forced = req.tools and choice_of_tool not in (None, "none", "auto")
    if forced:
        calls = forced_tool_calls(text, choice_of_tool) if final else []
        if choice_of_tool == "required" and finish == "stop":
            finish = "tool_calls"
        return ChatView(None, "", calls, finish)
    if state.parser is None:
        return ChatView(None, text, [], finish)
    parse_tools = bool(req.tools) and choice_of_tool == "auto" and state.config.enable_auto_tool_choice
    ids = choice.token_ids[: len(choice.token_ids) - (final and state.stopped_on_token(choice))]
    parsed = state.parser.parse(ids, text, parse_tools, choice.params.skip_special_tokens, final)
    if parsed.tool_calls and finish is not None:
        finish = "tool_calls"
    reasoning = parsed.reasoning if req.include_reasoning else None
    return ChatView(reasoning, parsed.content, parsed.tool_calls, finish)


def chat_message(view: ChatView) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": view.content, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "reasoning": view.reasoning,
                               "reasoning_content": view.reasoning}  # fmt: skip
    if view.tool_calls:
        message["tool_calls"] = view.tool_calls
    return message


async def chat(state: ServerState, req: ChatCompletionRequest) -> Any:
    adapter = state.adapter(req.model)
    choice_of_tool = tool_choice(state, req)
    prompt_ids, multimodal = chat_images(state, req, chat_prompt(state, req))
    params = req.sampling(state.max_tokens(len(prompt_ids), req.requested_max_tokens()), req.requested_logprobs())
    params.grammar = request_grammar(req.structured_outputs, req.response_format, req.tools, choice_of_tool)
    requests = state.requests(prompt_ids, params, req.n, 0, adapter, multimodal)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": adapter or state.model_name}
    if req.stream:
        return sse(chat_chunks(state, req, requests, prompt_ids, base, choice_of_tool))
    choices = await collect(state.engine, requests)
    out = []
    for c in choices:
        view = chat_view(state, req, c, choice_of_tool, final=True)
        item: dict[str, Any] = {
            "index": c.index,
            "message": chat_message(view),
            "logprobs": chat_logprobs(state, c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None,
            "finish_reason": view.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            item["token_ids"] = c.token_ids
        out.append(item)
    body = {**base, "object": "chat.completion", "choices": out, "usage": usage(len(prompt_ids), choices),
            "prompt_logprobs": state.prompt_logprobs(choices[0])}  # fmt: skip
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return FastJSONResponse(body)


def _suffix(sent: str, now: str | None) -> str:
    """The part of ``now`` a stream has not sent (nothing when ``now`` no longer extends what was sent)."""
    now = now or ""
    return now[len(sent) :] if now.startswith(sent) else ""


@dataclass
class _Sent:
    reasoning: str = ""
    content: str = ""
    tool_calls: int = 0


def chat_delta(view: ChatView, sent: _Sent) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if reasoning := _suffix(sent.reasoning, view.reasoning):
        delta["reasoning"] = delta["reasoning_content"] = reasoning
        sent.reasoning += reasoning
    if content := _suffix(sent.content, view.content):
        delta["content"] = content
        sent.content += content
    if len(view.tool_calls) > sent.tool_calls:
        new = view.tool_calls[sent.tool_calls :]
        delta["tool_calls"] = [{"index": sent.tool_calls + i, **call} for i, call in enumerate(new)]
        sent.tool_calls = len(view.tool_calls)
    return delta


async def chat_chunks(
    state: ServerState, req: ChatCompletionRequest, requests: list, prompt_ids: list[int], base: dict, tool_choice: Any
) -> AsyncIterator[dict[str, Any]]:
    chunk = {**base, "object": "chat.completion.chunk"}
    sent = [_Sent() for _ in requests]
    live: dict[int, Choice] = {}
    for i in range(len(requests)):
        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield _with_usage({**chunk, "choices": [role]}, req, len(prompt_ids), [])
    async for c, final in stream(state.engine, requests):
        live[c.index] = c
        view = chat_view(state, req, c, tool_choice, final)
        delta = chat_delta(view, sent[c.index])
        ids, lps, tops = c.unsent()
        logprobs = chat_logprobs(state, ids, lps, tops) if req.logprobs and ids else None
        if not delta and not final and logprobs is None:
            continue
        if req.return_token_ids:
            delta["token_ids"] = ids
        item = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": view.finish_reason,
                "stop_reason": c.stop_reason if final else None}  # fmt: skip
        yield _with_usage({**chunk, "choices": [item]}, req, len(prompt_ids), list(live.values()))
    if req.include_usage():
        yield {**chunk, "choices": [], "usage": usage(len(prompt_ids), list(live.values()))}


def _with_usage(chunk: dict[str, Any], req: Any, prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far."""
    if req.include_usage() and req.continuous_usage():
        chunk["usage"] = usage(prompt_tokens, choices)
    return chunk


# ---- completions ----


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
    for item in prompts:
        ids = list(state.tokenizer(item)["input_ids"]) if isinstance(item, str) else list(item)
        state.check_tokens(ids, "prompt")
        out.append((ids, item if isinstance(item, str) else None))
    return out


async def completion(state: ServerState, req: CompletionRequest) -> Any:
    adapter = state.adapter(req.model)
    prompts = completion_prompts(state, req)
    grammar = request_grammar(req.structured_outputs, req.response_format)
    requests, echoes = [], []
    for ids, text in prompts:
        params = req.sampling(
            state.max_tokens(len(ids), 16 if req.max_tokens is None else req.max_tokens), req.logprobs
        )
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
    out = []
    for c in choices:
        item: dict[str, Any] = {"index": c.index, "text": echoes[c.index] + state.text(c, final=True),
                                "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if req.logprobs is not None:
            item["logprobs"] = completion_logprobs(state, c.token_ids, c.logprobs, c.top_logprobs, 0, req.logprobs)
            if req.echo:
                item["logprobs"] = echo_logprobs(state, c, req.logprobs, item["logprobs"])
        item["prompt_logprobs"] = state.prompt_logprobs(c)
        if req.return_token_ids:
            item["prompt_token_ids"] = c.prompt_ids
            item["token_ids"] = c.token_ids
        out.append(item)
    return FastJSONResponse(
        {**base, "object": "text_completion", "choices": out, "usage": usage(prompt_tokens, choices)}
    )


async def completion_chunks(
    state: ServerState, req: CompletionRequest, requests: list, prompt_tokens: int, base: dict, echoes: list[str]
) -> AsyncIterator[dict[str, Any]]:
    chunk = {**base, "object": "text_completion"}
    live: dict[int, Choice] = {}
    echoed: set[int] = set()
    async for c, final in stream(state.engine, requests):
        live[c.index] = c
        text = state.text(c, final)
        delta, start = text[c.sent_text :], c.sent_text
        c.sent_text = max(c.sent_text, len(text))
        if c.index not in echoed:
            delta = echoes[c.index] + delta
        ids, lps, tops = c.unsent()
        logprobs = None
        if req.logprobs is not None and ids:
            logprobs = completion_logprobs(state, ids, lps, tops, start, req.logprobs)
            if req.echo and c.index not in echoed:
                logprobs = echo_logprobs(state, c, req.logprobs, logprobs)
        if not delta and not final and logprobs is None:
            continue
        echoed.add(c.index)
        item: dict[str, Any] = {"index": c.index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason if final else None}  # fmt: skip
        if req.return_token_ids:
            item["token_ids"] = ids
        yield _with_usage({**chunk, "choices": [item]}, req, prompt_tokens, list(live.values()))
    if req.include_usage():
        yield {**chunk, "choices": [], "usage": usage(prompt_tokens, list(live.values()))}
