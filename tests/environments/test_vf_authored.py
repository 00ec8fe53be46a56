"""Environments written from verifiers' documentation alone (tests/fixtures/vf_envs: vf-typed-tools, vf-few-shot,
vf-cart, vf-relay, vf-intercept), under our ``eval`` and verifiers' own eval against one scripted server: the same
rollouts, rewards and per-reward values, on the token-in route and the chat route, and the same tokens trained.

vf-typed-tools: the script calls the task's tool with its arguments (the Fahrenheit case leaves ``to`` at its
default; the sum comes after a parallel call the tool refuses, a value outside its ``Literal``; the mean with a
second, parallel call, add(1, 2)) and answers with the number the last tool returned: the mean is answered 3 in a
wordy reply (``correct`` = ``concise`` = 0).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from tests.environments.test_vf_eval import _tool_call
from tests.environments.test_vf_kinds import our_eval, vf_eval
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs
from tests.orchestrator.test_vf_envs import decode, orchestrate, samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CALLS = {
    "17 plus 25": ("math_add", {"a": 17, "b": 25}),
    "mean of 1, 2 and 4.5": ("math_mean", {"values": [1, 2, 4.5]}),
    "100 degrees Celsius in kelvin": ("math_convert", {"celsius": 100, "to": "kelvin"}),
    "20 degrees Celsius in Fahrenheit": ("math_convert", {"celsius": 20}),
}


def _tool_value(turn: str) -> str:
    text = re.search(r"<tool_response>\s*(.*?)\s*</tool_response>", turn, re.S).group(1)
    value = json.loads(text)
    return str(next(iter(value.values())) if isinstance(value, dict) else value)


def cart_script(prompt: str) -> str | None:
    """Adds one item per turn, checks out (not for the milk list: that total it answers unpaid) and answers."""
    wanted = re.search(r"Shopping list: (.*?)\. Add each", prompt)
    if wanted is None:
        return None
    items = [(item, int(n)) for n, item in re.findall(r"(\d+) (\w+)", wanted.group(1))]
    done = prompt.count("<tool_response>")
    if done < len(items):
        return _tool_call("cart_add", item=items[done][0], quantity=items[done][1])
    if items[0][0] == "milk":
        return "<answer>4.09</answer>"
    if done == len(items):
        return _tool_call("cart_checkout")
    return "<answer>" + _tool_value(prompt.rsplit("<|im_start|>user\n", 1)[-1]) + "</answer>"


def script(prompt: str) -> str | None:
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "Shopping list:" in prompt:
        return cart_script(prompt)
    if m := re.search(r"Say (\w+) in capitals\.<\|im_end\|>", prompt):  # vf-intercept: kiwi is not shouted
        return m.group(1) if m.group(1) == "kiwi" else m.group(1).upper()
    if m := re.search(r"Say (oak|elm|ash|fir|yew)\.<\|im_end\|>\n<\|im_start\|>assistant\n$", prompt):
        return "pine" if m.group(1) == "elm" else m.group(1)  # vf-relay: every word but elm
    if m := re.fullmatch(r"What is the capital of (\w+)\?<\|im_end\|>\n<\|im_start\|>assistant\n", last_user):
        return "<answer>" + {"Japan": "Tokyo", "Italy": "Roma"}.get(m.group(1), "?") + "</answer>"
    for question, (tool, arguments) in CALLS.items():
        if question in prompt:
            if "<tool_response>" not in last_user:  # the mean with a second, parallel call; the sum after a bad one
                if tool == "math_add":
                    return _tool_call("math_convert", celsius=1, to="rankine") + _tool_call(tool, **arguments)
                extra = _tool_call("math_add", a=1, b=2) if tool == "math_mean" else ""
                return _tool_call(tool, **arguments) + extra
            answer = f"<answer>{_tool_value(last_user)}</answer>"
            return f"The mean of the numbers you gave is {answer}" if tool == "math_mean" else answer
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("authored_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def _per_rollout(rows: list[dict]) -> Counter:
    return Counter((r["num_turns"], r["reward"], tuple(sorted(r["metrics"].items()))) for r in rows)


def _theirs(traces) -> Counter:
    return Counter(
        (
            t.num_turns,
            t.reward,
            tuple(sorted({**t.metrics, **{f"reward/{k}": v.score for k, v in t.rewards.items()}}.items())),
        )
        for t in traces
    )


NULL_AGENT = {"env": {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}}


@pytest.mark.slow  # a tool server per rollout: about 25 s per route
@pytest.mark.parametrize("use_chat", [False, True], ids=["token-in", "chat"])
def test_typed_tools_weighted_rewards_match_verifiers(server, tmp_path, monkeypatch, use_chat):
    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-typed-tools", "harness": "null"}, use_chat=use_chat)
    traces = vf_eval(tmp_path, server, "vf-typed-tools", use_chat=use_chat, **NULL_AGENT)
    assert _per_rollout(rows) == _theirs(traces)
    assert Counter(r["metrics"]["tool_calls"] for r in rows) == Counter({2.0: 4})  # parallel calls
    assert Counter(r["reward"] for r in rows) == Counter({1.75: 2, 0.5: 2})
    refused = "Input should be 'fahrenheit' or 'kelvin'"  # the Literal's validation error, as the tool's answer
    assert all(refused in r["completion"] for r in rows if r["reward"] == 1.75)


@pytest.mark.parametrize("use_chat", [False, True], ids=["token-in", "chat"])
def test_few_shot_keyed_rewards_match_verifiers(server, tmp_path, monkeypatch, use_chat):
    # Japan is answered Tokyo (exact), Italy Roma (an alias): 0.5 each, from one function's two keyed scores.
    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-few-shot", "harness": "null"}, use_chat=use_chat)
    traces = vf_eval(tmp_path, server, "vf-few-shot", use_chat=use_chat, **NULL_AGENT)
    assert _per_rollout(rows) == _theirs(traces)


def test_few_shot_turns_of_the_prompt_are_not_trained(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    m = orchestrate(tmp_path, server.config.model.name, server.url, {"id": "vf-few-shot", "harness": "null"})
    assert m["metrics/vf-few-shot/reward/exact"] == m["metrics/vf-few-shot/reward/alias"] == 0.5
    for ids, mask, _ in samples(tmp_path):
        trained = decode(server, ids[mask])
        assert "Paris" not in trained and "Madrid" not in trained, trained
        assert trained.startswith("<answer>")


@pytest.mark.slow  # a tool server per rollout, 4 turns: about 20-45 s per case
@pytest.mark.parametrize(("use_chat", "shared"), [(False, False), (True, False), (False, True)],
                         ids=["token-in", "chat", "taskset-toolset"])  # fmt: skip
def test_tool_state_kept_across_turns_is_what_the_rewards_read(server, tmp_path, monkeypatch, use_chat, shared):
    # The apple list: 2 adds + checkout over 4 turns, all rewards 1 (2.5); the milk list: 2 adds, no checkout (2.0).
    # With `shared`, one cart server per env worker serves every rollout, each with its own state.
    use_vf_envs(monkeypatch)
    args = {"task": {"shared": shared}}
    summary, rows = our_eval(tmp_path, server, {"id": "vf-cart", "harness": "null", "args": args}, use_chat=use_chat)
    traces = vf_eval(tmp_path, server, "vf-cart", use_chat=use_chat, taskset=args, **NULL_AGENT)
    assert _per_rollout(rows) == _theirs(traces)
    assert Counter(r["reward"] for r in rows) == Counter({2.5: 2, 2.0: 2})


def test_task_config_plugs_and_a_system_prompt_file_apply_as_in_verifiers(server, tmp_path, monkeypatch):
    # verifiers' run-time task knobs through our env `args`: the keyed reward reweighted (0.5 -> 2), a metric plugged
    # by import path, and the taskset's system_prompt file replacing each task's. vf-eval, given the same, agrees.
    use_vf_envs(monkeypatch)
    (tmp_path / "plugged_metric.py").write_text(
        "async def reply_len(trace):\n    return float(len(trace.last_reply))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ['PYTHONPATH']}")
    (tmp_path / "system.txt").write_text("Reply with the capital only, inside <answer></answer>.")
    args = {
        "system_prompt": str(tmp_path / "system.txt"),
        "task": {"rewards": {"match": {"weight": 2.0}}, "metrics": {"reply_len": {"fn": "plugged_metric:reply_len"}}},
    }
    _, rows = our_eval(tmp_path, server, {"id": "vf-few-shot", "harness": "null", "args": args})
    traces = vf_eval(tmp_path, server, "vf-few-shot", taskset=args, **NULL_AGENT)
    assert _per_rollout(rows) == _theirs(traces)
    assert {r["reward"] for r in rows} == {2.0} and {r["metrics"]["reply_len"] for r in rows} == {21.0, 22.0}
    assert all(r["prompt"].startswith("[system] Reply with the capital only") for r in rows)


@pytest.mark.slow  # an eval each side and two orchestrator steps: 9-25 s
def test_an_env_turn_of_several_messages_matches_verifiers(server, tmp_path, monkeypatch):
    # vf-relay answers each reply with two user messages (feedback, next word); elm is missed: oak-elm-ash scores
    # 2/3, elm-ash-fir 2/3, and each episode shows 5 user messages (the prompt, then 2 per env turn).
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {"id": "vf-relay"})
    traces = vf_eval(tmp_path, server, "vf-relay")
    assert _per_rollout(rows) == _theirs(traces)
    assert {(r["num_turns"], round(r["reward"], 4), r["metrics"]["user_messages"]) for r in rows} == {(3, 0.6667, 5.0)}
    assert "[user] Wrong: you were asked for elm.\n[user] Say ash." in rows[0]["completion"]
    # Training: one sample per episode holding all 3 turns; only the model's replies train.
    orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-relay"})
    for ids, mask, _ in samples(tmp_path / "run"):
        assert "you were asked" in decode(server, ids) and "asked" not in decode(server, ids[mask])
        assert decode(server, ids[mask]).replace("<|im_end|>", " ").split() in (
            ["oak", "pine", "ash"],
            ["pine", "ash", "fir"],
        )


@pytest.mark.slow  # an eval each side and two orchestrator steps (the fix's unit test: test_hostile_inference.py)
def test_intercepted_requests_and_responses_match_verifiers(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {"id": "vf-intercept", "harness": "null"})
    traces = vf_eval(tmp_path, server, "vf-intercept", **NULL_AGENT)
    assert _per_rollout(rows) == _theirs(traces)
    assert Counter(r["reward"] for r in rows) == Counter({1.0: 2, 0.0: 2})
    # verifiers keeps no token of a replaced reply (its node has none): training has nothing to learn from these
    # episodes, and none fails. Every rollout failed, "inference server ... answered no sampled token in trace 0 (an
    # empty completion)", and the step with it (RolloutsFailed).
    assert all(not any(b.sampled_mask) for t in traces for b in t.branches)
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-intercept", "harness": "null"})
    assert m["failed/rollouts"] == 0 and m["reward/mean"] == 0.5


def _trained(server, pairs) -> Counter:
    """(the sampled text, the sequence's length) of every sequence that trains something."""
    return Counter(
        (decode(server, [i for i, m in zip(ids, mask, strict=True) if m]), len(ids)) for ids, mask in pairs if any(mask)
    )


@pytest.mark.slow  # two orchestrator steps and an eval each: 20-60 s per env
@pytest.mark.parametrize("env_id", ["vf-few-shot", "vf-relay", "vf-typed-tools", "vf-cart"])
def test_what_trains_is_what_verifiers_marks_sampled(server, tmp_path, monkeypatch, env_id):
    use_vf_envs(monkeypatch)
    env = {"id": env_id} if env_id == "vf-relay" else {"id": env_id, "harness": "null"}
    # seq_len holds the longest episode whole (typed tools' sum: 1127 tokens; a longer one trains cut at seq_len)
    sampling = {"max_tokens": 48, "temperature": 1.0}
    orchestrate(tmp_path / "run", server.config.model.name, server.url, env, seq_len=2048, sampling=sampling)
    ours = _trained(server, [(ids.tolist(), mask.tolist()) for ids, mask, _ in samples(tmp_path / "run")])
    traces = vf_eval(tmp_path, server, env_id, **({} if env_id == "vf-relay" else NULL_AGENT))
    theirs = _trained(server, [(b.token_ids, b.sampled_mask) for t in traces for b in t.branches if b.trainable])
    assert ours == theirs
