"""Every environment kind through verifiers' OWN machinery against our inference server.

verifiers' eval (``run_eval``) runs each environment with its train client: prompts rendered by ``renderers``,
token-in ``/inference/v1/generate`` on the torch engine serving a tiny random model. A scripted engine answers the
prompts it recognizes (a ``<tool_call>`` block, the right answer), so rewards of 1.0 prove the whole path: tool schema
in the prompt, the call parsed and run, the tool result back in the next turn, the reward reading the final answer.
"""

from __future__ import annotations

import re

import pytest

from tests.fixtures.models import build_llama3_tokenizer, build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import local_agent, run_vf_eval, use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOOL_RENDERER = {"name": "default", "tool_parser": "qwen3"}


def _tool_call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _answer_from_tool(turn: str) -> str:
    return "<answer>" + re.search(r"<tool_response>\s*(\S+)", turn).group(1) + "</answer>"


def script(prompt: str) -> str | None:
    """Right answers for the prompts of the test environments; None lets the model sample."""
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "Is the response correct? yes or no." in prompt:  # vf-judge: the judge's own request
        return "yes"
    if m := re.search(r"code of (\w+)\?", prompt):  # vf-toolset
        if "<tool_response>" in last_user:
            return _answer_from_tool(last_user)
        return _tool_call("table_lookup", key=m.group(1))
    if m := re.search(r"Write (\d+) into the file answer.txt", prompt):  # vf-bash-runtime
        return (
            "done" if "<tool_response>" in last_user else _tool_call("bash", command=f"echo {m.group(1)} > answer.txt")
        )
    if m := re.search(r"What is ([\d+\-* ]+)\?", prompt):  # tool-use
        if "<tool_response>" in last_user:
            return _answer_from_tool(last_user)
        return _tool_call("calculator_evaluate", expression=m.group(1).strip())
    if m := re.search(r"Say (\w+)\.<\|im_end\|>\n<\|im_start\|>assistant\n$", prompt):  # vf-multi-turn
        return m.group(1)
    if "between 1 and" in prompt and "<guess>" in prompt:  # guess-number: binary search over the feedback so far
        high = int(re.search(r"between 1 and (\d+)", prompt).group(1))
        lo, hi = 1, high
        for guess, answer in re.findall(r"<guess>(\d+)</guess><\|im_end\|>\n<\|im_start\|>user\n(\w+)", prompt):
            lo, hi = (int(guess) + 1, hi) if answer == "higher" else (lo, int(guess) - 1)
        return f"<guess>{(lo + hi) // 2}</guess>"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def _eval(server, env_id, tmp_path, **kw):
    return run_vf_eval(env_id, server_url=server.url, model=server.config.model.name, output_dir=tmp_path, **kw)


def _traces(episodes):
    traces = [t for e in episodes for t in e.traces]
    assert all(e.ok for e in episodes), [t.errors for t in traces if t.errors]
    return traces


def test_single_turn(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    traces = _traces(_eval(server, "vf-single-turn", tmp_path, env={"agent": local_agent()}))
    assert len(traces) == 4
    for t in traces:
        assert t.num_turns == 1 and set(t.rewards) == {"exact"} and "reply_chars" in t.metrics
        (branch,) = t.branches
        # one sample: the rendered prompt unmasked, the sampled reply masked in, with a log-prob per sampled token
        assert 0 < sum(branch.sampled_mask) < len(branch.token_ids)
        assert all(lp <= 0 for lp, m in zip(branch.logprobs, branch.sampled_mask, strict=True) if m)


def test_multi_turn_env_answers_between_turns(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    traces = _traces(_eval(server, "vf-multi-turn", tmp_path, taskset={"turns": 3}))
    for t in traces:
        assert t.num_turns == 3 and t.metrics["turns"] == 3.0
        assert [m.role for m in t.messages] == ["system", "user", "assistant"] * 1 + ["user", "assistant"] * 2
        assert t.rewards["echoed"].score == 1.0
        # every turn extends the previous one: one training sample holding all turns, env turns masked out
        (branch,) = t.branches
        assert len(t.calls) == 3 and sum(branch.sampled_mask) == sum(c.usage.completion_tokens for c in t.calls)


def test_toolset_tool_runs_and_reward_is_one(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    # one task: each rollout starts a tool server process, which verifiers gives 180 s on a loaded host
    episodes = _eval(
        server, "vf-toolset", tmp_path, env={"agent": local_agent()}, renderer=TOOL_RENDERER, max_tokens=32, num_tasks=1
    )
    for t in _traces(episodes):
        assert [tool.name for tool in t.tools] == ["table_lookup"]
        assert [m.role for m in t.messages] == ["user", "assistant", "tool", "assistant"]
        assert t.reward == 1.0 and t.metrics["tool_calls"] == 1.0
        (branch,) = t.branches
        assert '"name": "table_lookup"' in _decode(server, branch.token_ids)  # the schema reached the prompt
        assert "<tool_response>" not in _decode(
            server, [i for i, m in zip(branch.token_ids, branch.sampled_mask, strict=True) if m]
        )


def test_bash_harness_reward_reads_the_runtime(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    agent = local_agent("bash") | {"harness": {"id": "bash", "edit": False, "compaction": None}}
    traces = _traces(
        _eval(server, "vf-bash-runtime", tmp_path, env={"agent": agent}, renderer=TOOL_RENDERER, max_tokens=32)
    )
    for t in traces:
        assert "bash" in [tool.name for tool in t.tools]
        assert t.rewards["wrote_answer"].score == 1.0


def test_judge_served_by_our_server(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    judge = {"base_url": f"{server.url}/v1", "model": server.config.model.name, "sampling": {"max_tokens": 8}}
    traces = _traces(
        _eval(server, "vf-judge", tmp_path, env={"agent": local_agent()}, taskset={"task": {"judge": judge}})
    )
    for t in traces:
        assert t.rewards["judged"].score == 1.0
        (call,) = t.info["judge_calls"]
        assert call["request"]["model"] == server.config.model.name


def test_infinite_taskset_draws_what_the_run_asks(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    traces = _traces(_eval(server, "vf-infinite", tmp_path, env={"agent": local_agent()}, num_tasks=3, num_rollouts=1))
    assert sorted(t.task.data.idx for t in traces) == [0, 1, 2]


def test_guess_number_is_a_multi_turn_game(server, tmp_path):
    episodes = _eval(server, "guess-number", tmp_path, taskset={"high": 16, "max_guesses": 6}, max_tokens=8)
    for t in _traces(episodes):
        assert t.metrics["solved"] == 1.0 and t.num_turns == t.metrics["num_guesses"] >= 1
        assert t.rewards["win"].score >= 0.5
    assert max(t.num_turns for t in _traces(episodes)) > 1


def test_tool_use_calls_the_calculator(server, tmp_path):
    episodes = _eval(
        server, "tool-use", tmp_path, env={"agent": local_agent()}, renderer=TOOL_RENDERER, max_tokens=48, num_tasks=1
    )
    for t in _traces(episodes):
        assert [tool.name for tool in t.tools] == ["calculator_evaluate"]
        assert t.reward == 1.0 and t.metrics["tool_calls"] == 1.0


@pytest.mark.parametrize("env_id", ["reverse-text", "arithmetic"])
def test_single_turn_environments_score_under_verifiers(server, tmp_path, env_id):
    traces = _traces(_eval(server, env_id, tmp_path, env={"agent": local_agent()}))
    assert all(t.num_turns == 1 and 0.0 <= t.reward <= 1.0 for t in traces)


def test_llama3_template_model_multi_turn(tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    model = save_tiny_model(tmp_path / "llama", build_llama3_tokenizer(), family="llama")
    srv = ScriptedServer(model, lambda prompt: None)
    try:
        traces = _traces(
            run_vf_eval(
                "vf-multi-turn", server_url=srv.url, model=str(model), output_dir=tmp_path / "out", max_tokens=8
            )
        )
    finally:
        srv.stop()
    for t in traces:
        assert t.num_turns == 3
        text = _decode(srv, t.branches[-1].token_ids)
        assert "<|start_header_id|>assistant<|end_header_id|>" in text and "<|im_start|>" not in text


def _decode(server, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.config.model.name).decode(ids)


def test_color_shapes_vision_under_verifiers(tmp_path):
    from tests.fixtures.models import save_tiny_qwen3_vl_model

    model = save_tiny_qwen3_vl_model(tmp_path / "vl")
    srv = ScriptedServer(model, lambda prompt: None)
    try:
        episodes = run_vf_eval(
            "color-shapes",
            server_url=srv.url,
            model=str(model),
            output_dir=tmp_path / "out",
            env={"agent": local_agent()},
            renderer={"name": "qwen3-vl"},
        )
    finally:
        srv.stop()
    for t in _traces(episodes):
        assert t.num_turns == 1 and sum(t.branches[0].mm_token_type_ids) > 0


def test_arithmetic_scores_right_answers_and_a_power_tower_zero(tmp_path):
    """Under verifiers' eval the reward runs math-verify in its child process: right answers score 1, and a boxed
    power tower (sympy computed it for ever, inside the event loop that runs the rollouts) scores 0."""
    from arithmetic import generate_examples

    answers = {e["prompt"]: e["answer"] for e in generate_examples(2, seed=0)}
    tower = next(iter(answers))

    def arithmetic(prompt: str) -> str | None:
        for problem, answer in answers.items():
            if problem in prompt:
                return "\\boxed{9^{9^{9^{9}}}}" if problem == tower else f"so \\boxed{{{answer}}}"
        return None

    model = save_tiny_model(tmp_path / "model", build_tool_tokenizer())
    srv = ScriptedServer(model, arithmetic)
    try:
        episodes = run_vf_eval(
            "arithmetic",
            server_url=srv.url,
            model=str(model),
            output_dir=tmp_path / "out",
            env={"agent": local_agent()},
            max_tokens=48,
        )
    finally:
        srv.stop()
    traces = _traces(episodes)
    assert sorted(t.reward for t in traces) == [0.0, 0.0, 1.0, 1.0]
    assert all(t.reward == 0.0 for t in traces if "9^{9^" in t.last_reply)
