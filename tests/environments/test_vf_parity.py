"""One environment (tests/fixtures/vf_envs/vf_parity) under our ``eval`` and under verifiers' own eval against the
same scripted server: the same rewards, turns and per-reward values, for what an author can declare beyond a plain
reward: weighted rewards, a seat's own ``max_turns``, a whole-episode ``retries`` that recovers a flaky grader.

The script says the word it is asked for, so each turn hits: ``said`` = turns / times, ``brief`` = 1 (weight 0.5).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.environments.test_vf_eval import TOOL_RENDERER
from tests.environments.test_vf_kinds import our_eval, script, vf_eval
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import run_vf_eval, use_vf_envs
from tests.orchestrator.test_vf_envs import orchestrate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("parity_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def test_a_rollout_verifiers_retried_to_success_trains_as_a_success(server, tmp_path, monkeypatch):
    # The grader raises once per task; the env's retries = 1 reruns the episode, which verifiers stamps ok (its
    # earlier attempt's error kept in the history): vf-eval scores it, so must we.
    use_vf_envs(monkeypatch)
    args, env_args = {"flaky": True, "times": 2}, {"retries": {"max_retries": 1}}
    summary, rows = our_eval(tmp_path, server, {"id": "vf-parity", "args": args, "env_args": env_args})
    traces = vf_eval(tmp_path, server, "vf-parity", taskset=args, env=env_args)
    assert Counter(t.reward for t in traces) == Counter(r["reward"] for r in rows) == Counter({1.5: 4})
    assert summary["failed"] == 0


def test_a_seat_keeps_the_max_turns_its_environment_declares(server, tmp_path, monkeypatch):
    # The seat declares max_turns = 2 and the task asks for 3 words: vf-eval stops after 2 turns (said = 2/3).
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {"id": "vf-parity"})
    traces = vf_eval(tmp_path, server, "vf-parity")
    assert Counter((t.num_turns, round(t.reward, 4)) for t in traces) == Counter({(2, 1.1667): 4})
    assert Counter((r["num_turns"], round(r["reward"], 4)) for r in rows) == Counter({(2, 1.1667): 4})


def test_a_max_turns_the_run_sets_wins_over_the_seats_own(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {"id": "vf-parity", "max_turns": 1})
    assert Counter((r["num_turns"], round(r["reward"], 4)) for r in rows) == Counter({(1, 0.8333): 4})


def test_each_reward_and_metric_is_reported_by_name_as_verifiers_reports_it(server, tmp_path, monkeypatch):
    # verifiers' run summary (prime_runs.metrics.from_episodes, what vf-eval pushes): each reward function's own
    # score, unweighted (brief = 1.0 at weight 0.5), and each metric. Ours: reward/<name> and <name> per rollout,
    # and their means in the eval summary (metrics/<name>).
    from prime_runs.metrics import from_episodes

    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-parity"})
    theirs = from_episodes([], vf_eval(tmp_path, server, "vf-parity"))["avg_metrics"]
    assert theirs == {"said": pytest.approx(2 / 3), "brief": 1.0, "turns": 2.0}
    ours = {k.removeprefix("reward/"): sum(r["metrics"][k] for r in rows) / len(rows) for k in rows[0]["metrics"]}
    assert ours == theirs
    means = {
        k.removeprefix("metrics/").removeprefix("reward/"): v for k, v in summary.items() if k.startswith("metrics/")
    }
    assert means == theirs
    # Training logs the same, per environment (metrics.jsonl, W&B), on the seat's own 2 turns.
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-parity"})
    logged = {k.removeprefix("metrics/vf-parity/").removeprefix("reward/"): v for k, v in m.items()
              if k.startswith("metrics/vf-parity/")}  # fmt: skip
    assert logged == theirs


OPEN = {"id": "vf-parity", "env_id": "vf-open-turns"}


def test_a_seat_that_declares_no_turn_limit_runs_until_the_env_is_done(server, tmp_path, monkeypatch):
    # 12 words asked of a seat with no declared limit: vf-eval plays all 12 turns (said = 1); "auto" cut it at 8.
    use_vf_envs(monkeypatch)
    _, rows = our_eval(tmp_path, server, {**OPEN, "args": {"times": 12}})
    traces = vf_eval(tmp_path, server, "vf-parity", taskset={"times": 12}, env={"id": "vf-open-turns"})
    assert Counter((t.num_turns, t.reward) for t in traces) == Counter({(12, 1.5): 4})
    assert Counter((r["num_turns"], r["reward"]) for r in rows) == Counter({(12, 1.5): 4})


def test_a_seat_with_no_turn_limit_still_ends_where_the_context_is_full(tmp_path_factory, tmp_path, monkeypatch):
    # A task that never lets go (10000 words) on a 256-token context: both evals end the episode at the context,
    # ok and scored on the turns that fit; no turn cap is needed for the episode to end.
    use_vf_envs(monkeypatch)
    model = save_tiny_model(tmp_path_factory.mktemp("small_ctx_model"), build_tool_tokenizer())
    small = ScriptedServer(model, script, max_model_len=256)
    try:
        _, rows = our_eval(tmp_path, small, {**OPEN, "args": {"times": 10000}})
        traces = vf_eval(tmp_path, small, "vf-parity", taskset={"times": 10000}, env={"id": "vf-open-turns"})
    finally:
        small.stop()
    turns = Counter(t.num_turns for t in traces)  # the same per task (their words' lengths differ)
    assert min(turns) > 2 and max(turns) < 100
    assert Counter(r["num_turns"] for r in rows) == turns


def test_an_episode_the_env_accepts_though_its_seat_failed_is_scored_as_verifiers_keeps_it(
    server, tmp_path, monkeypatch
):
    # The grader raises once per task and nothing retries: that trace fails and its episode is not ok, but the env's
    # Env.complete accepts it (tolerant): vf-eval keeps it (its resume does not redo it) and scores its traces.
    # We failed it (reward 0, nothing trained) whatever the env said.
    from prime_orchestrator.env_config import resolve
    from verifiers.v1.utils.loaders import load_environment

    use_vf_envs(monkeypatch)
    import vf_parity

    args, env_args = {"flaky": True, "times": 2}, {"tolerant": True}
    summary, rows = our_eval(tmp_path, server, {**OPEN, "args": args, "env_args": env_args})
    vf_parity._SCORED.clear()  # the flake is once per task and process: this process may have scored them
    episodes = run_vf_eval("vf-parity", server_url=server.url, model=server.config.model.name, output_dir=tmp_path / "vf",
                           taskset=args, env={"id": "vf-open-turns", **env_args}, max_tokens=48, renderer=TOOL_RENDERER)  # fmt: skip
    env = load_environment(resolve({"id": "vf-open-turns", "taskset": {"id": "vf-parity", **args}, **env_args}))
    assert sum(not e.ok for e in episodes) == 2 and all(env.complete(e) for e in episodes)
    assert Counter(t.reward for e in episodes for t in e.traces) == Counter(r["reward"] for r in rows)
    assert summary["failed"] == 0


def test_a_multi_seat_summary_names_metrics_as_verifiers_summarizes_them(server, tmp_path, monkeypatch):
    # vf-eval's run summary pools each metric over every seat's traces by its own name (word_len: 3 and 8 -> 5.5),
    # where ours had only per-seat keys (first/word_len): no metrics/word_len to compare. Per-seat keys stay, as
    # vf-eval's per-role rows.
    from prime_runs.metrics import from_episodes

    use_vf_envs(monkeypatch)
    summary, _ = our_eval(tmp_path, server, {"id": "vf-duel"})
    theirs = from_episodes([], vf_eval(tmp_path, server, "vf-duel"))
    assert theirs["avg_metrics"] == {"word_len": 5.5, "win": 0.0} and theirs["avg_reward"] == 0.0
    assert summary["reward/mean"] == theirs["avg_reward"]
    assert {k: summary[f"metrics/{k}"] for k in ("word_len", "reward/win")} == {"word_len": 5.5, "reward/win": 0.0}
    assert summary["metrics/first/word_len"] == 3.0 and summary["metrics/second/reward/win"] == 1.0
    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, {"id": "vf-duel"})
    assert m["metrics/vf-duel/word_len"] == 5.5 and m["metrics/vf-duel/second/word_len"] == 8.0


def test_a_reward_that_raises_leaves_what_verifiers_recorded_in_the_summary(server, tmp_path, monkeypatch):
    # vf-probe: every second task's reward raises after its metrics were recorded (reply_chars 6, 2 turns). vf-eval
    # marks those traces failed and still counts their turns and metrics (avg_metrics reply_chars = (3+3+6+6)/4).
    # Ours dropped them: reply_chars 3.0, and num_turns/mean 1.0 as if the failed episodes played no turn.
    from prime_runs.metrics import from_episodes

    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-probe", "args": {"faults": True}}, failures=True)
    episodes = run_vf_eval("vf-probe", server_url=server.url, model=server.config.model.name, output_dir=tmp_path / "vf",
                           taskset={"faults": True}, max_tokens=48, renderer=TOOL_RENDERER)  # fmt: skip
    theirs = from_episodes(episodes)
    assert theirs == {"avg_reward": 0.5, "avg_error": 0.5,
                      "avg_metrics": {"said": 1.0, "reply_chars": 4.5, "stopped_by_task": 1.0}}  # fmt: skip
    assert summary["failed"] / len(rows) == theirs["avg_error"] and summary["reward/mean"] == theirs["avg_reward"]
    means = {
        k.removeprefix("metrics/").removeprefix("reward/"): v for k, v in summary.items() if k.startswith("metrics/")
    }
    assert means == theirs["avg_metrics"]
    # Each rollout as vf-eval recorded it: turns (the @vf.stop after 2), ok stamp, reward.
    ours = Counter((r["num_turns"], not r["failed"], r["reward"]) for r in rows)
    assert ours == Counter((t.num_turns, e.ok, t.reward) for e in episodes for t in e.traces)
    assert summary["num_turns/mean"] == 2.0


def test_a_stop_condition_and_trace_derived_metrics_match_verifiers_per_rollout(server, tmp_path, monkeypatch):
    # vf-probe: a @vf.stop ends each episode after the second time the word is said (the env would ask 5 times, the
    # seat has no turn limit); metrics read the trace's stop condition and the reply. Per rollout and in summary.
    from prime_runs.metrics import from_episodes

    use_vf_envs(monkeypatch)
    summary, rows = our_eval(tmp_path, server, {"id": "vf-probe"})
    traces = vf_eval(tmp_path, server, "vf-probe")
    assert {t.stop_condition for t in traces} == {"said_twice"}
    theirs = Counter((t.num_turns, t.reward, tuple(sorted(t.metrics.items()))) for t in traces)
    ours = Counter(
        (r["num_turns"], r["reward"], tuple(sorted((k, v) for k, v in r["metrics"].items() if "/" not in k)))
        for r in rows
    )
    assert ours == theirs == Counter({(2, 1.0, (("reply_chars", 3.0), ("stopped_by_task", 1.0))): 2,
                                      (2, 1.0, (("reply_chars", 6.0), ("stopped_by_task", 1.0))): 2})  # fmt: skip
    means = {
        k.removeprefix("metrics/").removeprefix("reward/"): v for k, v in summary.items() if k.startswith("metrics/")
    }
    assert means == from_episodes([], traces)["avg_metrics"]
