"""OpenAI chat completions on our engines (the torch engine; vLLM serves its own), as vLLM 0.26's chat server answers
them: prompts from the chat template, tool calls (forced ones constrained to the parser's syntax and the tools'
schemas), reasoning, ``echo``, log-probs, responses and stream chunks. Completions: `prime_inference.completions_serving`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prime_core.chat_tokens import encode_plain, has_special_text, inert, injected_spans, special_tokens

from prime_inference.chat_parsing import FORCED_CALL_MARKERS, FORCED_CALL_SYNTAX, forced_tool_calls
from prime_inference.chat_protocol import ChatCompletionRequest
from prime_inference.completions_serving import token_entries
from prime_inference.protocol import RequestError
from prime_inference.serving import Choice, FastJSONResponse, ServerState, collect, sse, stream, usage, with_usage
from prime_inference.structured import forced_call_grammar, json_tool_grammar, request_grammar


def chat_logprobs(state: ServerState, ids: list[int], lps: list[float], tops: list[dict[int, float]], k: int) -> dict:
    """vLLM's chat log-probs: each token's ``top_logprobs`` are the first k of (the token, then the top k by rank)."""
    content = []
    for tid, lp, top in zip(ids, lps, tops, strict=True):
        tok = state.token_str(tid)
        entries = list(token_entries(tid, lp, top).items())[:k]
        alternatives = [{"token": (t := state.token_str(a)), "logprob": max(v, -9999.0), "bytes": list(t.encode())}
                        for a, v in entries]  # fmt: skip
        content.append({"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode()),
                        "top_logprobs": alternatives})  # fmt: skip
    return {"content": content}


def tool_choice(state: ServerState, req: ChatCompletionRequest) -> str | dict | None:
    """vLLM's rules: tools without a tool_choice mean "auto"; "auto" needs auto tool choice, any other choice but
    "none" a tool-call parser. The 400 adds what this server was started with."""
    from prime_inference.tool_calling import no_parser_hint

    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else None)
    if not req.tools or choice in (None, "none"):
        return choice
    if choice == "auto" and not state.config.auto_tool_choice:
        message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        raise RequestError(message + no_parser_hint(state.config), param="tool_choice")
    if choice != "auto" and state.config.tool_parser is None:
        named = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
        message = f"tool_choice={named} requires --tool-call-parser to be set"
        raise RequestError(message + no_parser_hint(state.config), param="tool_choice")
    return choice


def forced(req: ChatCompletionRequest, choice: Any) -> bool:
    return bool(req.tools) and choice not in (None, "none", "auto")


def forced_tool_grammar(state: ServerState, req: ChatCompletionRequest, choice: Any) -> str | None:
    """A required or named tool choice's grammar: the parser's own call syntax where one is known (vLLM 0.26's
    structural tag), else vLLM's JSON form."""
    if not forced(req, choice):
        return None
    tools = req.template_tools() or []
    syntax = FORCED_CALL_SYNTAX.get(state.config.tool_parser)
    if syntax is None:
        return json_tool_grammar(tools, choice)
    return forced_call_grammar(tools, choice, syntax, state.single_tokens(FORCED_CALL_MARKERS))


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise RequestError("the served model's tokenizer has no chat template; use /v1/completions")
    messages = [m.template_dict() for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.template_tools()
    if req.documents is not None:
        kwargs["documents"] = req.documents

    def render(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        try:
            return state.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # jinja errors (raise_exception in templates), bad kwargs
            raise RequestError(f"chat template failed: {e}", param="messages") from e

    text = render(messages, kwargs)
    ids = state.encode(text, bool(req.add_special_tokens), "messages")
    specials = special_tokens(state.tokenizer)
    if not specials or not has_special_text([messages, kwargs], specials):
        return ids
    # Special-token text the request brought in (a user's, a tool result's) is plain text: only the template's own
    # special tokens are special, or a message could forge turns and roles (prime_core.chat_tokens).
    injected = injected_spans(text, render(inert(messages, specials), inert(kwargs, specials)), specials)
    if injected is None:
        raise RequestError(
            "the messages hold special-token text and the chat template changes its length, so it cannot be told "
            "from the template's own special tokens",
            param="messages",
        )
    plain = encode_plain(state.tokenizer, text, injected, specials)["input_ids"]
    if req.add_special_tokens:  # the post-processor's tokens (a BOS) around the text, as `ids` has them
        added = state.tokenizer("", add_special_tokens=True)["input_ids"]
        lead = next((i for i, (a, b) in enumerate(zip(added, ids, strict=False)) if a != b), min(len(added), len(ids)))
        plain = added[:lead] + plain + added[lead:]
    return plain


async def chat_images(state: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]) -> tuple[list[int], Any]:
    """Decode the messages' image parts and expand each rendered placeholder to the image's token run."""
    urls = [u for m in req.messages for u in m.image_urls()]
    if not urls:
        return prompt_ids, None
    from prime_inference.multimodal import decode_images_off_loop

    multimodal = await decode_images_off_loop(urls, state.vision, "messages")
    try:
        prompt_ids = state.vision.expand_placeholders(prompt_ids, multimodal.image_grid_thw)
    except ValueError as e:
        raise RequestError(f"{e} (does the chat template render image parts?)", param="messages") from e
    return prompt_ids, multimodal


def response_role(req: ChatCompletionRequest) -> str:
    """vLLM: the assistant's, unless the last message is continued (no generation prompt): then that message's."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content when it has the answer's role."""
    last = req.messages[-1]
    if not req.echo or last.role != response_role(req) or not last.content:
        return ""
    return (
        last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content if p.type == "text")
    )


@dataclass
class ChatView:
    """What a choice says so far: reasoning, content and tool calls, and the finish reason to report."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


def chat_view(state: ServerState, req: ChatCompletionRequest, choice: Choice, choice_of_tool: Any, final: bool,
              streaming: bool = False) -> ChatView:  # fmt: skip
    text = state.text(choice, final)
    finish = choice.finish_reason
    if state.parser is None:
        return ChatView(None, text, [], finish)
    thinking = bool((req.chat_template_kwargs or {}).get("enable_thinking", True))
    is_forced = forced(req, choice_of_tool)
    if is_forced and state.config.tool_parser not in FORCED_CALL_SYNTAX:  # vLLM's JSON form
        reasoning, content = state.parser.split_reasoning(text, thinking, final)
        calls = forced_tool_calls(content or "", choice_of_tool) if final else []
        content = ""
    else:
        parse_tools = bool(req.tools) and (is_forced or (choice_of_tool == "auto" and state.config.auto_tool_choice))
        ids = choice.token_ids[: len(choice.token_ids) - (final and state.stopped_on_token(choice))]
        parsed = state.parser.parse(ids, text, parse_tools, choice.params.skip_special_tokens, final, thinking)
        reasoning, content, calls = parsed.reasoning, parsed.content, parsed.tool_calls
        content = (content or "") if is_forced else content
    if req.parallel_tool_calls is False:  # vLLM and OpenAI: the first call only
        calls = calls[:1]
    # OpenAI's finish reasons, as vLLM gives them: tool_calls for auto and required, stop for a named function.
    called = choice_of_tool == "auto" or (choice_of_tool == "required" and (streaming or finish == "stop"))
    if finish is not None and calls and called:
        finish = "tool_calls"
    return ChatView(reasoning if req.include_reasoning else None, content, calls, finish)


def chat_message(view: ChatView, role: str, echo: str) -> dict[str, Any]:
    content = echo + (view.content or "") if echo else view.content
    message: dict[str, Any] = {"role": role, "content": content, "refusal": None, "annotations": None, "audio": None,
                               "function_call": None, "reasoning": view.reasoning,
                               "reasoning_content": view.reasoning}  # fmt: skip
    if view.tool_calls:
        message["tool_calls"] = view.tool_calls
    return message


async def chat(state: ServerState, req: ChatCompletionRequest) -> Any:
    adapter = state.adapter(req.model)
    choice_of_tool = tool_choice(state, req)
    prompt_ids, multimodal = await chat_images(state, req, chat_prompt(state, req))
    params = req.sampling(state.max_tokens(len(prompt_ids), req.requested_max_tokens()), req.requested_logprobs())
    tool_grammar = forced_tool_grammar(state, req, choice_of_tool)
    params.grammar = request_grammar(req.structured_outputs, req.response_format, tool_grammar)
    plain = adapter is None and multimodal is None and state.engine.supports_prompt_logprobs
    if req.echo and params.prompt_logprobs is None and plain:
        params.prompt_logprobs = req.top_logprobs or 0  # vLLM: an echo returns the prompt's log-probs
    requests = state.requests(prompt_ids, params, req.n, 0, adapter, multimodal)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": adapter or state.model_name}
    if req.stream:
        return sse(chat_chunks(state, req, requests, prompt_ids, base, choice_of_tool))
    choices = await collect(state.engine, requests)
    out, k = [], req.top_logprobs or 0
    for c in choices:
        view = chat_view(state, req, c, choice_of_tool, final=True)
        item: dict[str, Any] = {
            "index": c.index,
            "message": chat_message(view, response_role(req), echoed(req)),
            "logprobs": chat_logprobs(state, c.token_ids, c.logprobs, c.top_logprobs, k) if req.logprobs else None,
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
    role, echo, k = response_role(req), echoed(req), req.top_logprobs or 0
    for i in range(len(requests)):
        first = {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        yield with_usage({**chunk, "choices": [first]}, req, len(prompt_ids), [])
    for i in range(len(requests) if echo else 0):
        item = {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
        yield with_usage({**chunk, "choices": [item]}, req, len(prompt_ids), [])
    async for c, final in stream(state.engine, requests):
        live[c.index] = c
        view = chat_view(state, req, c, tool_choice, final, streaming=True)
        delta = chat_delta(view, sent[c.index])
        ids, lps, tops = c.unsent()
        logprobs = chat_logprobs(state, ids, lps, tops, k) if req.logprobs and ids else None
        if not delta and not final and logprobs is None:
            continue
        if req.return_token_ids:
            delta["token_ids"] = ids
        item = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": view.finish_reason,
                "stop_reason": c.stop_reason if final else None}  # fmt: skip
        yield with_usage({**chunk, "choices": [item]}, req, len(prompt_ids), list(live.values()))
    if req.include_usage():
        yield {**chunk, "choices": [], "usage": usage(len(prompt_ids), list(live.values()))}
