"""OpenAI-client checks of vLLM's behaviour that run unchanged against either engine on a real (random) model: the
torch engine on CPU in test_openai_surface.py, vLLM on a GPU in test_openai_surface_vllm.py.

`check_forced_tool_call_and_reasoning` forces the output with a one-string Lark grammar (llguidance on both
engines) in which the markers are token references, favoured with logit_bias."""

from __future__ import annotations

import json
import re

import httpx

from .surface import BOUNDED_TOOLS, MARKERS, THINK_TEXT, TOOL_CALL_TEXT, TOOLS

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def marker_bias(tokenizer) -> dict[str, float]:
    return {str(tokenizer.convert_tokens_to_ids(m)): 30.0 for m in MARKERS}


def forced(text: str, tokenizer) -> dict:
    """A one-string Lark grammar in which each marker is its token (``<[id]>``, llguidance's token reference): as
    text, llguidance would refuse the added token that spells it."""
    pattern = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
    parts = [f"<[{tokenizer.convert_tokens_to_ids(p)}]>" if p in MARKERS else json.dumps(p)
             for p in pattern.split(text) if p]  # fmt: skip
    return {"structured_outputs": {"grammar": "start: " + " ".join(parts)}, "logit_bias": marker_bias(tokenizer)}


def check_forced_tool_call_and_reasoning(client, model: str, tokenizer) -> None:
    messages = [{"role": "user", "content": "weather in Paris?"}]
    extra = forced(THINK_TEXT + TOOL_CALL_TEXT, tokenizer)
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=80,
                                       extra_body=extra)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert (choice.message.content or "").strip() == ""
    assert choice.message.model_extra["reasoning"].strip() == "I should call the tool."
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=80, stream=True, extra_body=extra)  # fmt: skip
    reasoning, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert reasoning.strip() == "I should call the tool." and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def check_structured_outputs(client, model: str, eos_text: str = "") -> None:
    """``eos_text``: what the engine may leave after a grammar-complete JSON value (see the vLLM test)."""
    messages = [{"role": "user", "content": "weather as json"}]
    # Thinking off, as Qwen3 users ask for JSON: with it on, vLLM 0.26's qwen3 parser counts output without
    # </think> as reasoning (the template may open the think block), so the JSON would land in `reasoning`.
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    schema_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                       response_format=schema_format, extra_body=no_think)  # fmt: skip
    assert r.choices[0].message.content.lstrip().startswith("{")  # JSON allows free whitespace, which may run long
    # The torch engine honours the request's disable_any_whitespace; vLLM 0.26 only its server-wide setting, which
    # the vLLM test sets.
    compact = {"json": WEATHER_SCHEMA, "disable_any_whitespace": True}
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                           stream=stream, extra_body={"structured_outputs": compact, **no_think})  # fmt: skip
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
        value = json.loads(text.removesuffix(eos_text) if eos_text else text)
        assert set(value) == {"city", "days"} and 0 <= value["days"] <= 9
    # Thinking off here too: with it on, vLLM's qwen3 parser files a grammar-forced "yes" (no </think>) as reasoning.
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1, seed=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}, **no_think})  # fmt: skip
    answer = r.choices[0].message.content
    assert answer.removesuffix(eos_text) in ("yes", "no"), answer
    r = client.completions.create(model=model, prompt="numbers", max_tokens=6, temperature=1, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})  # fmt: skip
    digits = r.choices[0].text
    assert len(digits) == 3 and digits.isdigit(), digits


def check_named_tool_choice(client, model: str) -> None:
    """A named function as ``tool_choice``: the output is constrained to that tool's call."""
    messages = [{"role": "user", "content": "weather as json"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    # Thinking off: the prompt then ends in an empty think block, so vLLM applies the grammar from the first token
    # (unless enable_in_reasoning, it waits for </think>) and its qwen3 parser reads the call as content.
    # Sampled, not greedy: vLLM's tool-call grammar allows any JSON whitespace, where a greedy random-init model
    # can stay until max_tokens.
    r = client.chat.completions.create(model=model, messages=messages, tools=BOUNDED_TOOLS, tool_choice=named,
                                       max_tokens=200, temperature=1, seed=7,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Berlin")


def check_tolerant_requests(client, model: str) -> None:
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    echoed = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": [tool_call], "reasoning": "I should call the tool."}  # fmt: skip
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "weather?"}, echoed,
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=3, temperature=0, store=False,
        metadata={"run": "x"}, reasoning_effort="low", service_tier="auto", modalities=["text"],
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def check_sampling_parameters(client, model: str, url: str) -> None:
    base = {"model": model, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0}
    forced_id = 9
    r = httpx.post(
        f"{url}/v1/completions", json={**base, "logit_bias": {str(forced_id): 100}, "return_token_ids": True}
    )
    assert r.json()["choices"][0]["token_ids"] == [forced_id] * 5
    r = httpx.post(f"{url}/v1/completions", json={**base, "allowed_token_ids": [11, 12], "return_token_ids": True,
                                                  "temperature": 1, "seed": 0})  # fmt: skip
    assert set(r.json()["choices"][0]["token_ids"]) <= {11, 12}
    r = httpx.post(f"{url}/v1/completions", json={**base, "n": 2})  # duplicates at temperature 0: refused
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json={**base, "top_p": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    chunks = list(client.completions.create(
        model=model, prompt="the quick", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))  # fmt: skip
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    assert with_choices[-1].usage.completion_tokens == chunks[-1].usage.completion_tokens == 4
    r = client.completions.create(model=model, prompt="the quick", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("the quick")
    r = client.completions.create(model=model, prompt="the quick", max_tokens=3, temperature=0, best_of=1)
    assert len(r.choices) == 1


def check_token_in_sampling_fields(url: str, tokenizer) -> None:
    """The RL route (``/inference/v1/generate``, token ids in and out) honours every sampling field it accepts: a field
    dropped on one engine changes what a rollout samples there and nowhere else."""

    def generate(**sampling) -> dict:
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 6, "temperature": 1, "seed": 0, **sampling}}
        r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, (sampling, r.text[:300])
        return r.json()["choices"][0]

    forced = 9
    assert generate(logit_bias={str(forced): 100})["token_ids"] == [forced] * 6
    assert set(generate(allowed_token_ids=[11, 12])["token_ids"]) <= {11, 12}
    assert generate(min_p=1.0)["token_ids"] == generate(temperature=0)["token_ids"]  # min_p = 1 leaves the top one
    # A bias that makes one token the greedy choice, which the penalties then take away once it has repeated.
    biased = {"temperature": 0, "logit_bias": {str(forced): 8}}
    assert generate(**biased)["token_ids"] == [forced] * 6
    for penalty in ({"frequency_penalty": 2.0}, {"repetition_penalty": 50.0}):
        assert generate(**biased, **penalty)["token_ids"] != [forced] * 6, penalty
    choice = generate(max_tokens=8, structured_outputs={"choice": ["alpha", "beta"]})
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) in ("alpha", "beta")
    digits = generate(max_tokens=8, structured_outputs={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(digits["token_ids"], skip_special_tokens=True))
    value = generate(max_tokens=60, structured_outputs={"json": WEATHER_SCHEMA, "disable_any_whitespace": True})
    assert set(json.loads(tokenizer.decode(value["token_ids"], skip_special_tokens=True))) == {"city", "days"}


def check_tokenize_routes(url: str, model: str) -> None:
    tok = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    text = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": tok["tokens"]}).json()["prompt"]
    assert text == "hello world"
    chat = httpx.post(f"{url}/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > tok["count"] - 2
    assert "version" in httpx.get(f"{url}/version").json()
    assert httpx.get(f"{url}/ping").status_code == 200


# ---- the 14 cases where the torch engine used to answer otherwise than vLLM 0.26 (issue #40) ----

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
REQUIRED, NAMED = "required", {"type": "function", "function": {"name": "get_weather"}}


def _stream_calls(stream) -> tuple[dict, str, str | None]:
    calls, content, finish = {}, "", None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, content, finish


def _bounded_arguments(arguments: str) -> None:
    """What the tool's schema allows: exactly {"city": "Paris" | "Berlin"}."""
    value = json.loads(arguments)
    assert set(value) == {"city"} and value["city"] in ("Paris", "Berlin"), arguments


def check_forced_tool_calls(client, model: str) -> None:
    """``tool_choice`` required and named, plain and streamed: the output is constrained to the tool's JSON schema
    (in the parser's call syntax) and comes back as tool calls; finish reasons as OpenAI's (tool_calls for required,
    stop for a named function). Thinking off: vLLM binds the grammar once reasoning has ended (an empty think block
    in the prompt); sampled, as a greedy random-init model can stay in the JSON's free whitespace."""
    messages = [{"role": "user", "content": "weather as json"}]
    for choice, finish in ((REQUIRED, "tool_calls"), (NAMED, "stop")):
        kw = {"model": model, "messages": messages, "tools": BOUNDED_TOOLS, "tool_choice": choice, "max_tokens": 200,
              "temperature": 1, "seed": 3, "extra_body": NO_THINK}  # fmt: skip
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == finish, r.choices[0]
        assert message.tool_calls and not message.content, message
        for call in message.tool_calls:
            assert call.function.name == "get_weather" and call.id
            _bounded_arguments(call.function.arguments)
        calls, content, streamed_finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
        assert calls and not content.strip() and streamed_finish == finish, (calls, content, streamed_finish)
        for call in calls.values():
            assert call["name"] == "get_weather"
            _bounded_arguments(call["arguments"])


def check_reasoning_without_think_block(client, model: str, tokenizer) -> None:
    """``--reasoning-parser qwen3`` with thinking on (the default): output without ``</think>`` is all reasoning and
    ``content`` is None (the chat template may have opened the think block)."""
    # No marker and no special token (skipped from the text), and no early EOS: six tokens of plain text.
    banned = [tokenizer.convert_tokens_to_ids(m) for m in MARKERS] + list(tokenizer.all_special_ids)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logit_bias={str(t): -100 for t in banned},
                                       extra_body={"min_tokens": 6})  # fmt: skip
    message = r.choices[0].message
    assert message.content is None and message.model_extra["reasoning"], message


def check_unknown_field_ignored(url: str, model: str) -> None:
    """vLLM ignores a top-level field it does not know (and logs it) rather than answering 400."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "no_such_option": 1}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    prompt = {"model": model, "prompt": "hi", "max_tokens": 2, "no_such_option": {"a": 1}}
    assert httpx.post(f"{url}/v1/completions", json=prompt, timeout=120).status_code == 200


def check_echo(client, model: str, tokenizer) -> None:
    """Completions: the echoed prompt's positions carry their token and its top alternatives (at most k + 1
    entries, the token among them), the first none. Chat: the continued last message leads the content."""
    r = client.completions.create(model=model, prompt="the quick brown", max_tokens=2, temperature=0, logprobs=1,
                                  echo=True)  # fmt: skip
    lp = r.choices[0].logprobs
    prompt_len = len(tokenizer("the quick brown")["input_ids"])
    assert len(lp.tokens) == prompt_len + 2 and r.choices[0].text.startswith("the quick brown")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in top and 1 <= len(top) <= 2, (token, top)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello world"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False,
                                                   "continue_final_message": True, **NO_THINK})  # fmt: skip
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.startswith("hello world")


def check_raw_logprobs_by_default(url: str, model: str) -> None:
    """vLLM's default log-probs are raw (log_softmax of the logits): the same at temperature 0.7 and 1.5, and not
    the log 1 = 0 of the processed distribution when ``allowed_token_ids`` leaves one token."""
    values = []
    for temperature in (0.7, 1.5):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1, "temperature": temperature, "seed": 0,
                "logprobs": 0, "allowed_token_ids": [9]}  # fmt: skip
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["logprobs"]["tokens"] and choice["logprobs"]["top_logprobs"][0]
        values.append(choice["logprobs"]["token_logprobs"][0])
    assert values[0] < -1e-3 and abs(values[0] - values[1]) < 2e-2, values


def check_refused_requests(url: str, model: str, stop_limit: int | None = 16) -> None:
    """What vLLM answers 400, naming the field in ``param``. ``stop_limit``: the most stop strings the server takes
    (the torch engine 16, as vLLM's later releases; vLLM 0.26 has no limit)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]
    cases = [
        ({**chat, "tool_choice": "auto"}, "tool_choice"),
        ({**chat, "temperature": 3}, "temperature"),
        ({**chat, "tools": bad_tool}, "tools"),
        ({**chat, "messages": [{"role": "user", "content": None}]}, "messages"),
    ]
    for body, param in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), (body, r.text)
    stops = {**chat, "stop": [f"s{i}" for i in range(17)]}
    r = httpx.post(f"{url}/v1/chat/completions", json=stops, timeout=120)
    if stop_limit is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
