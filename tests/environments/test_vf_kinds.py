"""Environments of each kind a verifiers user writes (tests/fixtures/vf_envs, only verifiers' public API), with
default settings, under our ``eval`` and two orchestrator steps, and under verifiers' own eval against the same
server: the same rewards. A scripted engine plays the policy (and the judge) so each reward is known:

- vf-duel, a two-player zero-sum game: the first seat says "cat", the second "elephant": -1 and +1, every episode.
- vf-attempts, one seat tried twice: attempt 1 says the word (1 + 0.5 for the first hit), attempt 2 does not (0).
- vf-bash-runtime, verifiers' default bash harness: the model writes the file, the reward reads it back (1.0).
- vf-rubric, verifiers' rubric judge plugged with its hosted default endpoint: the run points it at the policy's
  own server, which answers the verdict (1.0).
- vf-toolset, a per-task toolset, over the chat route (``use_chat``): the server returns the call as ``tool_calls``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from prime_core.config.orchestrator import EvalConfig

from tests.environments.test_vf_eval import TOOL_RENDERER
from tests.environments.test_vf_eval import script as base_script
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import VF_ENVS, run_vf_eval, use_vf_envs
from tests.orchestrator.test_vf_envs import orchestrate, samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

VERDICT = json.dumps({"verdicts": [{"name": "answers", "reason": "it states a number", "verdict": "yes"}]})


def script(prompt: str) -> str | None:
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "Respond with ONLY a JSON object" in prompt:  # the rubric judge's request
        return VERDICT
    if "Duel: name one" in last_user:
        return "elephant" if "Your opponent said" in last_user else "cat"
    if m := re.search(r"Say the word (\w+)\. Attempt (\d+) of", last_user):
        return m.group(1) if m.group(2) == "1" else "no"
    if re.search(r"What is \d+ times three\?", last_user):
        return "It is a number."
    return base_script(prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Default settings: the chat route parses tool calls with the parser the chat template's format names.
    model = save_tiny_model(tmp_path_factory.mktemp("kinds_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def our_eval(
    tmp_path: Path, server, env: dict, *, use_chat: bool = False, failures: bool = False
) -> tuple[dict, list[dict]]:
    """Our eval's summary and rows; ``failures``: rollouts may fail (else none may)."""
    from prime_orchestrator.eval_runner import run_eval

    config = EvalConfig.model_validate(
        {
            "model": {"name": server.config.model.name},
            "output_dir": str(tmp_path / "eval"),
            "env": [env],
            "client": {"base_url": server.url},
            "num_examples": 2,
            "rollouts_per_example": 2,
            "sampling": {"max_tokens": 48, "temperature": 1.0},
            "use_chat": use_chat,
        }
    )
    (summary,) = asyncio.run(run_eval(config))["base"].values()
    rows = json.loads((tmp_path / "eval" / "eval" / "base" / f"{env['id']}.json").read_text())["rollouts"]
    assert failures or summary["failed"] == 0, [r["error"] for r in rows]
    return summary, rows


def vf_eval(tmp_path: Path, server, env_id: str, *, env: dict | None = None, use_chat: bool = False, **kw) -> list:
    episodes = run_vf_eval(
        env_id,
        server_url=server.url,
        model=server.config.model.name,
        output_dir=tmp_path / "vf",
        env=env,
        max_tokens=48,
        client_type="eval" if use_chat else "train",
        # what our client.renderer = "auto" picks for this tokenizer (vf-eval's own auto has no tool parser)
        renderer=None if use_chat else TOOL_RENDERER,
        **kw,
    )
    assert all(e.ok for e in episodes), [t.errors for e in episodes for t in e.traces if t.errors]
    return [t for e in episodes for t in e.traces]


def seat_rewards(rows: list[dict]) -> Counter:
    return Counter((seat, reward) for r in rows for seat, reward in r["traces"])


def test_two_player_zero_sum_game_scores_each_seat(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-duel"})
    assert seat_rewards(rows) == Counter({("first", -1.0): 4, ("second", 1.0): 4})
    assert summary["reward/first/mean"] == -1.0 and summary["reward/second/mean"] == 1.0
    assert rows[0]["metrics"] == {"first/word_len": 3.0, "first/reward/win": -1.0, "second/word_len": 8.0,
                                  "second/reward/win": 1.0}  # fmt: skip
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-duel"})
    assert m["reward/vf-duel/first/mean"] == -1.0 and m["reward/vf-duel/second/mean"] == 1.0
    assert m["samples/trained"] == 8  # both seats of every episode train
    assert m["metrics/vf-duel/second/word_len"] == 8.0


def test_multi_attempt_env_each_attempt_has_its_own_reward(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {"id": "vf-attempts"})
    assert [r["traces"] for r in rows] == [[["agent", 1.5], ["agent", 0.0]]] * 4
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-attempts"})
    assert m["samples/trained"] == 8 and m["advantage/nonzero_fraction"] == 1.0  # 1.5 vs 0 within each group
    trained = samples(tmp_path / "run")
    assert len(trained) == 8


def test_bash_harness_by_default_reward_reads_the_runtime(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-bash-runtime"})
    assert summary["reward/mean"] == 1.0 and all("bash" in r["completion"] for r in rows)
    assert (
        orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-bash-runtime"})["reward/mean"]
        == 1.0
    )


def test_rubric_judge_is_served_by_the_run_itself(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    judged = server.engine.scripted_requests
    summary, rows = our_eval(tmp_path, server, {"id": "vf-rubric"})
    assert summary["reward/mean"] == 1.0 and {r["metrics"]["reward/rubric"] for r in rows} == {1.0}
    assert server.engine.scripted_requests >= judged + 8  # 4 answers and 4 verdicts from the policy's server
    assert (
        orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-rubric"})["reward/mean"] == 1.0
    )


def test_per_task_toolset_over_the_chat_route_returns_tool_calls(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-toolset", "harness": "null"}
    summary, rows = our_eval(tmp_path, server, env, use_chat=True)
    assert summary["reward/mean"] == 1.0 and all("[tool_call table_lookup(" in r["completion"] for r in rows)


LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}
RUBRIC = {"id": "rubric", "path": str(VF_ENVS / "vf_rubric" / "criteria.toml"), "view": "last_reply"}


def vf_eval_args(env_id: str, server) -> dict:
    """What a verifiers user passes to vf-eval for the run our eval makes: a local runtime where the env declares
    none, the judge's endpoint, the harness and client route the test names."""
    judge = {"base_url": f"{server.url}/v1", "model": server.config.model.name}
    return {
        "vf-duel": {},
        "vf-attempts": {},
        "vf-bash-runtime": {"env": LOCAL},
        "vf-rubric": {"env": LOCAL, "taskset": {"task": {"judges": [{**RUBRIC, **judge}]}}},
        "vf-toolset": {"env": {"agent": {"harness": {"id": "null"}, **LOCAL["agent"]}}, "use_chat": True},
    }[env_id]


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["vf-duel", "vf-attempts", "vf-bash-runtime", "vf-rubric", "vf-toolset"])
def test_vf_eval_against_our_server_gives_the_rewards_of_our_eval(server, tmp_path, monkeypatch, env_id):
    use_vf_envs(monkeypatch)
    args = vf_eval_args(env_id, server)
    env = {"id": env_id, **({"harness": "null"} if env_id == "vf-toolset" else {})}
    _, rows = our_eval(tmp_path, server, env, use_chat=args.get("use_chat", False))
    traces = vf_eval(tmp_path, server, env_id, **args)
    assert Counter((t.agent.name, t.reward) for t in traces) == seat_rewards(rows)
