"""verifiers' built-in Envs (``verifiers.v1.envs``) paired with a test taskset, as a verifiers user would with
``--env.id``, under our ``eval`` and two orchestrator steps. A scripted engine plays every agent so each reward is
known; what the authors meant each env to do is checked on the host side:

- user-sim: a modeled user (untrainable) asks for the word, then ends the talk with the done marker; the assistant,
  who never sees the task's prompt, answers and is scored by the task's reward (1.0). The user's turns are served
  by the policy's own server; the trained samples are the assistant's alone; verifiers' own eval agrees.
- best-of-n: ``n`` attempts per episode, each scored by the task and trained; ``best`` and ``pass_at_n`` (against
  the env's ``threshold``) compare the siblings.
- single-agent: named explicitly, the same as the taskset's default.
- isolated-verifier: the solver plays in a ``sandbox_pool`` runtime; the task's reward runs in a fresh one.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from tests.environments.test_vf_kinds import our_eval, vf_eval
from tests.environments.test_vf_kinds import script as kinds_script
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import local_agent, use_vf_envs
from tests.orchestrator.test_vf_envs import decode, orchestrate, samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

USER_SIM_DONE = "###DONE###"


def script(prompt: str) -> str | None:
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "You are role-playing a USER" in prompt:  # user-sim's modeled user
        if "<answer>" in last_user:
            return USER_SIM_DONE
        word = re.search(r"Repeat the word (\w+)\.", prompt).group(1)
        return f"Please say {word} for me."
    if m := re.search(r"Write (\d+) into answer.txt with one shell line\.", last_user):  # vf-isolated
        return f"echo {m.group(1)} > answer.txt"
    if m := re.search(r"Please say (\w+) for me\.", last_user):  # the assistant, told by the user
        return f"<answer>{m.group(1)}</answer>"
    if m := re.search(r"Repeat the word (\w+)\.", last_user):  # vf-single-turn played directly
        return f"<answer>{m.group(1)}</answer>"
    return kinds_script(prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("builtin_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def test_user_sim_trains_the_assistant_only(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-single-turn", "env_id": "user-sim", "harness": "null"}
    before = server.engine.scripted_requests
    summary, rows = our_eval(tmp_path, server, env)
    assert summary["reward/mean"] == 1.0 and [r["traces"] for r in rows] == [[["assistant", 1.0]]] * 4
    assert {r["metrics"]["user_turns"] for r in rows} == {2.0}  # asks, then ends the talk with the done marker
    # 2 user turns + 1 assistant turn per episode, all answered by the policy's own server
    assert server.engine.scripted_requests - before == 12
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, env)
    assert m["reward/mean"] == 1.0 and m["samples/trained"] == 4
    for ids, mask, _ in samples(tmp_path / "run"):
        text, trained = decode(server, ids), decode(server, ids[mask])
        assert "Please say" in text and "role-playing" not in text and USER_SIM_DONE not in text
        assert re.fullmatch(r"<answer>\w+</answer><\|im_end\|>\s*", trained), trained
    # verifiers' own eval against the same server: the same assistant rewards
    seats = {"assistant": local_agent(), "user": local_agent()}
    traces = vf_eval(tmp_path, server, "vf-single-turn", env={"id": "user-sim", **seats})
    assert Counter((t.agent.name, t.reward, t.agent.trainable) for t in traces) == Counter(
        {("assistant", 1.0, True): 4, ("user", 0.0, False): 4}
    )


@pytest.mark.slow  # ran as they are with no change of ours: pinned outside CI's 40 minutes
def test_best_of_n_scores_each_attempt_and_compares_siblings(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    # threshold 2: no attempt reaches it, so pass_at_n is 0 while every attempt is right and best
    env = {"id": "vf-single-turn", "env_id": "best-of-n", "env_args": {"n": 3, "threshold": 2.0}, "harness": "null"}
    summary, rows = our_eval(tmp_path, server, env)
    assert [r["traces"] for r in rows] == [[["agent", 1.0]] * 3] * 4
    assert {(r["metrics"]["best"], r["metrics"]["pass_at_n"]) for r in rows} == {(1.0, 0.0)}
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, env)
    assert m["reward/mean"] == 1.0 and m["samples/trained"] == 12  # every attempt of every episode trains
    assert m["metrics/vf-single-turn/best"] == 1.0 and m["metrics/vf-single-turn/pass_at_n"] == 0.0


@pytest.mark.slow  # ran as they are with no change of ours: pinned outside CI's 40 minutes
def test_single_agent_named_is_the_plain_run(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-single-turn", "env_id": "single-agent", "harness": "null"})
    assert summary["reward/mean"] == 1.0 and [r["traces"] for r in rows] == [[["agent", 1.0]]] * 4


def test_isolated_verifier_scores_in_a_fresh_sandbox_pool_runtime(server, tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root")
    use_vf_envs(monkeypatch)
    # Both runtimes named only under env_args, as a verifiers user writes them: the solver's seat (the in-process
    # chat loop: the pool has no network for a harness program) and the verifier's fresh one.
    pool = {"runtime": {"type": "sandbox_pool"}}
    env = {"id": "vf-isolated", "env_id": "isolated-verifier", "harness": "prime-chat",
           "env_args": {"agent": pool, "verifier": pool}}  # fmt: skip
    summary, rows = our_eval(tmp_path, server, env)
    assert [r["traces"] for r in rows] == [[["agent", 1.0]]] * 4  # the reply ran in the verifier's runtime
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, env)
    assert m["reward/mean"] == 1.0 and m["samples/trained"] == 4
