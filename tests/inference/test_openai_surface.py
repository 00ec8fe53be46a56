"""The OpenAI surface behaves as vLLM's server, on the torch engine, through the official ``openai`` client: a test
engine that answers with a fixed tool call / think block / JSON (streamed and not), and a real tiny model for
constrained decoding and sampling parameters (the same cases run on vLLM in test_openai_surface_vllm.py)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from . import surface_cases as cases
from .helpers import start_server
from .surface import (
    ANSWER_TEXT,
    THINK_TEXT,
    TOOL_CALL_TEXT,
    TOOLS,
    FixedTextEngine,
    build_surface_tokenizer,
    save_surface_model,
)

PARSERS = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
NAMED = {"server": {"served_model_name": "m"}}


def reply(prompt: str) -> str:
    if "TWOCALLS" in prompt:
        return TOOL_CALL_TEXT + "\n" + TOOL_CALL_TEXT.replace("Paris", "Rome")
    if "TOOLCALL" in prompt:
        return THINK_TEXT + TOOL_CALL_TEXT
    if "REASON" in prompt:
        return THINK_TEXT + ANSWER_TEXT
    if "JSONOUT" in prompt:
        return '{"city": "Paris", "days": 3}'
    return ANSWER_TEXT


def fixed_server(tmp_path_factory, **config):
    tokenizer = build_surface_tokenizer()
    model_dir = tmp_path_factory.mktemp("fixed")
    tokenizer.save_pretrained(model_dir)
    engine = FixedTextEngine(tokenizer, reply)
    server = start_server(model_dir, engine_factory=lambda: (engine, tokenizer), **NAMED, **config)
    server.engine, server.tokenizer = engine, tokenizer
    return server


@pytest.fixture(scope="module")
def parsing(tmp_path_factory):
    s = fixed_server(tmp_path_factory, **PARSERS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    s = fixed_server(tmp_path_factory, tool_call_parser="none")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    """No parser settings: tool calling is on by default (the template writes hermes calls), reasoning is not."""
    s = fixed_server(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def surface_model(tmp_path_factory):
    return save_surface_model(tmp_path_factory.mktemp("surface") / "model")


def real_server(model_dir, **config):
    s = start_server(model_dir, max_model_len=1024, **NAMED, **PARSERS, **config)
    s.tokenizer = build_surface_tokenizer()
    return s


@pytest.fixture(scope="module")
def real(surface_model):
    s = real_server(surface_model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def processed(surface_model):
    """Log-probs of the distribution each token was drawn from, as `rl` serves them."""
    s = real_server(surface_model, logprobs_mode="processed")
    yield s
    s.stop()


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def ask(server, content: str, **kw):
    messages = [{"role": "user", "content": content}]
    return client(server).chat.completions.create(model="m", messages=messages, max_tokens=80, temperature=0, **kw)


def streamed(server, content: str, **kw) -> dict:
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in ask(server, content, stream=True, **kw):
        for c in chunk.choices:
            out["reasoning"] += (c.delta.model_extra or {}).get("reasoning") or ""
            out["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = out["calls"].setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            out["finish"] = c.finish_reason or out["finish"]
    return out


def test_fixed_tool_call_with_reasoning_streamed_and_not(parsing):
    r = ask(parsing, "TOOLCALL", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert (choice.message.content or "").strip() == ""
    assert choice.message.model_extra["reasoning"] == "\nI should call the tool.\n"
    s = streamed(parsing, "TOOLCALL", tools=TOOLS)
    assert s["finish"] == "tool_calls" and s["reasoning"] == "\nI should call the tool.\n"
    assert s["content"].strip() == ""  # the block never leaks into the streamed content
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    # tool_choice none: no parsing of tool calls, the block stays in the content (reasoning is still separated)
    r = ask(parsing, "TOOLCALL", tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.strip() == TOOL_CALL_TEXT


def test_parallel_tool_calls_false_keeps_the_first_call_as_vllm_and_openai(parsing):
    # OpenAI: parallel_tool_calls=false, at most one call per turn; vLLM keeps the first (streamed: index 0 only).
    # Ours returned both calls.
    def cities(**kw):
        calls = ask(parsing, "TWOCALLS", tools=TOOLS, **kw).choices[0].message.tool_calls
        return [json.loads(c.function.arguments)["city"] for c in calls]

    assert cities() == cities(parallel_tool_calls=True) == ["Paris", "Rome"]
    assert cities(parallel_tool_calls=False) == ["Paris"]
    s = streamed(parsing, "TWOCALLS", tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c["arguments"])["city"] for c in s["calls"].values()] == ["Paris"]
    assert s["finish"] == "tool_calls"


def test_fixed_think_block_streamed_and_not(parsing):
    r = ask(parsing, "REASON")
    message = r.choices[0].message
    assert message.content == "\n\n" + ANSWER_TEXT and message.model_extra["reasoning"] == "\nI should call the tool.\n"
    assert message.tool_calls is None and r.choices[0].finish_reason == "stop"
    s = streamed(parsing, "REASON")
    assert s["content"] == message.content and s["reasoning"] == message.model_extra["reasoning"]
    hidden = ask(parsing, "REASON", extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == message.content


def test_fixed_json_and_plain_text_without_parsers(plain):
    r = ask(plain, "JSONOUT")
    assert json.loads(r.choices[0].message.content) == {"city": "Paris", "days": 3}
    assert streamed(plain, "JSONOUT")["content"] == r.choices[0].message.content
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(ask(plain, "JSONOUT", stream=True, stream_options=options))
    assert (
        all(c.usage is not None for c in chunks)
        and chunks[-1].usage.completion_tokens == chunks[-2].usage.completion_tokens
    )
    r = ask(plain, "REASON")  # no reasoning parser: the think block is content, as on vLLM
    assert r.choices[0].message.content == THINK_TEXT + ANSWER_TEXT
    with pytest.raises(Exception) as err:  # tools need both settings, as on vLLM; the 400 names them
        ask(plain, "TOOLCALL", tools=TOOLS)
    assert err.value.status_code == 400 and "--enable-auto-tool-choice" in err.value.message
    assert "tool_call_parser=none" in err.value.message
    r = httpx.post(f"{plain.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                   "tools": TOOLS, "tool_choice": "required"})  # fmt: skip
    assert r.status_code == 400 and "requires --tool-call-parser to be set" in r.json()["error"]["message"]


def test_tool_calling_is_on_by_default_where_the_template_renders_tools(defaults, caplog):
    r = ask(defaults, "TOOLCALL", tools=TOOLS)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments)["city"] == "Paris"
    # No reasoning parser unless asked: the think block stays in the content before the call.
    assert r.choices[0].message.content.strip() == THINK_TEXT.strip()
    assert defaults.config.tool_call_parser == "auto"  # resolved at start, the config as given stays as it was


def test_tolerant_requests_render_as_vllm(parsing):
    cases.check_tolerant_requests(client(parsing), "m")
    prompt = parsing.engine.prompts[-1]
    assert "<|im_start|>system\nbe brief" in prompt  # developer is system
    assert '"arguments": {"city": "Paris"}' in prompt  # arguments decoded: the template iterated them
    assert "<think>\nI should call the tool.\n</think>" in prompt  # history's reasoning reached the template
    # a response's message goes back into the history as the SDK gives it
    first = ask(parsing, "TOOLCALL", tools=TOOLS).choices[0].message
    history = [{"role": "user", "content": "TOOLCALL"}, first.model_dump(exclude_none=False),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}]  # fmt: skip
    again = client(parsing).chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5)
    assert again.choices[0].message is not None


def test_stop_token_text_left_out_unless_asked(plain):
    think_end = plain.tokenizer.convert_tokens_to_ids("</think>")
    r = ask(plain, "REASON", extra_body={"stop_token_ids": [think_end]}).choices[0]
    assert r.message.content == "<think>\nI should call the tool.\n" and r.finish_reason == "stop"
    assert r.model_extra["stop_reason"] == think_end
    kept = ask(plain, "REASON", extra_body={"stop_token_ids": [think_end], "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "<think>\nI should call the tool.\n</think>"
    s = streamed(plain, "REASON", extra_body={"stop_token_ids": [think_end]})
    assert s["content"] == r.message.content


def test_validation_errors_name_the_parameter(plain):
    url, chat = plain.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body, param in [
        ({**chat, "n": 2, "temperature": 0}, "n"),
        ({**chat, "temperature": -1}, "temperature"),
        ({**chat, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**chat, "tool_choice": "required"}, "tool_choice"),
        ({**chat, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({**chat, "max_tokens": 100_000}, "max_tokens"),
    ]:
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_tokenize_routes_and_admin_paths(plain):
    cases.check_tokenize_routes(plain.url, "m")
    assert httpx.get(f"{plain.url}/v1/health").status_code == 404  # admin routes answer at the root only
    assert httpx.post(f"{plain.url}/v1/pause").status_code == 404
    assert "X-Weight-Step" not in httpx.get(f"{plain.url}/health").headers
    r = httpx.post(f"{plain.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.headers["X-Weight-Step"] == "0"


def test_forced_tool_call_and_reasoning_on_a_real_model(real):
    # the same check as on vLLM: a Lark grammar with token references forces the think block and the call
    cases.check_forced_tool_call_and_reasoning(client(real), "m", real.tokenizer)


def test_structured_outputs_on_a_real_model(real):
    cases.check_structured_outputs(client(real), "m")
    cases.check_named_tool_choice(client(real), "m")
    r = httpx.post(f"{real.url}/v1/generate", json={"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 8, "temperature": 1, "seed": 2, "structured_outputs": {"choice": ["alpha", "beta"]}}})  # fmt: skip
    text = real.tokenizer.decode(r.json()["choices"][0]["token_ids"], skip_special_tokens=True)
    assert text in ("alpha", "beta")


def test_sampling_parameters_on_a_real_model(real):
    cases.check_sampling_parameters(client(real), "m", real.url)
    cases.check_tolerant_requests(client(real), "m")
    cases.check_token_in_sampling_fields(real.url, real.tokenizer)


def test_prompt_logprobs_and_echo_match_a_reference_forward(real):
    prompt = [5, 6, 7, 8]
    lps = torch.log_softmax(reference_logits(real.config.model.name, prompt, last=False), -1)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    got = httpx.post(f"{real.url}/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = got[pos][str(prompt[pos])]
        assert abs(entry["logprob"] - float(lps[pos - 1, prompt[pos]])) < 1e-4
        assert entry["rank"] == int((lps[pos - 1] > lps[pos - 1, prompt[pos]]).sum()) + 1
        assert {str(t) for t in torch.topk(lps[pos - 1], 2).indices.tolist()} <= set(got[pos])
    echo = httpx.post(f"{real.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                           "echo": True, "logprobs": 1}).json()["choices"][0]  # fmt: skip
    assert len(echo["logprobs"]["tokens"]) == len(prompt) + 2 and echo["logprobs"]["token_logprobs"][0] is None
    assert abs(echo["logprobs"]["token_logprobs"][1] - float(lps[0, prompt[1]])) < 1e-4
    gen = httpx.post(f"{real.url}/v1/generate", json={"token_ids": prompt, "sampling_params": {
        "max_tokens": 1, "prompt_logprobs": 0}}).json()  # fmt: skip
    assert gen["prompt_logprobs"][1] == {str(prompt[1]): got[1][str(prompt[1])]}  # k = 0: the prompt token alone


def reference_logits(model_dir, ids: list[int], last: bool = True) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits[-1] if last else logits


def test_penalties_and_logit_bias_follow_vllms_formulas(processed):
    real = processed
    prompt, penalties = [5, 6, 7, 5, 6], {"repetition_penalty": 1.7, "frequency_penalty": 0.9, "presence_penalty": 0.6}
    bias = {"12": 4.0, "30": -3.0}
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 0,
                                                      "logit_bias": bias, **penalties}}  # fmt: skip
    choice = httpx.post(f"{real.url}/v1/generate", json=body).json()["choices"][0]
    tokens = choice["token_ids"]
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    for i, token in enumerate(tokens):
        logits = reference_logits(real.config.model.name, prompt + tokens[:i])
        logits[12] += 4.0
        logits[30] -= 3.0
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + tokens[:i]] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.7, logits * 1.7), logits)
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=logits.numel()).float()
        logits = logits - 0.9 * counts - 0.6 * (counts > 0).float()
        assert token == int(torch.argmax(logits))  # greedy: processed log-probs are the penalised logits'
        assert abs(lps[i] - float(torch.log_softmax(logits, -1)[token])) < 1e-4


def test_processed_log_probs_are_those_sampled_from(processed):
    real = processed
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 2.0, "top_k": 1,
                                                         "logprobs": 0, "seed": 0}}  # fmt: skip
    content = httpx.post(f"{real.url}/v1/generate", json=body).json()["choices"][0]["logprobs"]["content"]
    assert all(abs(e["logprob"]) < 1e-6 for e in content)  # top_k=1 leaves one token: log 1
    body["sampling_params"].update(top_k=0, min_p=1.0)
    content = httpx.post(f"{real.url}/v1/generate", json=body).json()["choices"][0]["logprobs"]["content"]
    assert all(abs(e["logprob"]) < 1e-6 for e in content)


def test_skip_special_tokens(real):
    im_start = real.tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "logit_bias": {str(im_start): 100}}
    kept = httpx.post(f"{real.url}/v1/completions", json={**body, "skip_special_tokens": False}).json()
    skipped = httpx.post(f"{real.url}/v1/completions", json=body).json()
    assert kept["choices"][0]["text"] == "<|im_start|><|im_start|>" and skipped["choices"][0]["text"] == ""


def test_forced_tool_calls_follow_the_tool_schema(real):
    cases.check_forced_tool_calls(client(real), "m")


def test_reasoning_echo_and_log_probs_as_vllm(real):
    cases.check_reasoning_without_think_block(client(real), "m", real.tokenizer)
    cases.check_echo(client(real), "m", real.tokenizer)
    cases.check_raw_logprobs_by_default(real.url, "m")


def test_unknown_fields_are_ignored_and_logged_bad_values_refused(real, caplog):
    with caplog.at_level(logging.WARNING, logger="prime_inference.protocol"):
        cases.check_unknown_field_ignored(real.url, "m")
    assert "no_such_option" in caplog.text
    cases.check_refused_requests(real.url, "m")
