"""The verifiers config an environment runs with: ``auto`` keeps each seat's own harness and runtime (as vf-eval
would), the null chat loop runs in-process on the local runtime, and every judge is pointed at the run's endpoint."""

from __future__ import annotations

import asyncio

import pytest
from prime_core.config.orchestrator import ClientConfig, EnvConfig, JudgeEndpointConfig
from prime_core.schemas.rollout import EnvServerSpec
from prime_orchestrator.env_config import env_config_data
from prime_orchestrator.judges import JudgeEndpoint, JudgeUnreachable, check_judges, env_judges, judge_endpoint

from tests.fixtures.vf import use_vf_envs

ENDPOINT = JudgeEndpoint("http://127.0.0.1:9/v1", "policy", None, 300.0)


def seats(env: dict, judge: JudgeEndpoint | None = None) -> dict[str, tuple[str | None, str]]:
    data = env_config_data(EnvConfig(**env), judge)
    return {k: ((v.get("harness") or {}).get("id"), v["runtime"]["type"]) for k, v in data.items()
            if isinstance(v, dict) and "runtime" in v}  # fmt: skip


@pytest.fixture(autouse=True)
def _envs(monkeypatch):
    use_vf_envs(monkeypatch)


def test_auto_keeps_the_environments_own_harness_and_runtime():
    # a taskset with no harness of its own: verifiers' default bash agent (unset = the taskset default), locally
    assert seats({"id": "vf-bash-runtime"}) == {"agent": (None, "subprocess")}
    assert seats({"id": "vf-single-turn"}) == {"agent": (None, "subprocess")}
    # a seat the env declares on docker keeps docker; explicit settings win over the env's
    assert seats({"id": "vf-bash-runtime", "runtime": "docker"}) == {"agent": (None, "docker")}
    assert seats({"id": "vf-bash-runtime", "harness": "bash"})["agent"][0] == "bash"


def test_the_null_chat_loop_runs_in_process_on_the_local_runtime_only():
    # both seats declare verifiers' null on subprocess; reverse-text exports null under its own name
    assert seats({"id": "vf-duel"}) == {"first": ("prime-chat", "subprocess"), "second": ("prime-chat", "subprocess")}
    assert seats({"id": "reverse-text"}) == {"agent": ("prime-chat", "subprocess")}
    assert seats({"id": "vf-single-turn", "harness": "null"}) == {"agent": ("prime-chat", "subprocess")}
    assert seats({"id": "vf-single-turn", "harness": "null", "runtime": "docker"}) == {"agent": ("null", "docker")}


def test_every_judge_of_the_config_is_pointed_at_the_run_endpoint():
    rubric = env_judges(env_config_data(EnvConfig(id="vf-rubric"), ENDPOINT))
    in_code = env_judges(env_config_data(EnvConfig(id="vf-judge"), ENDPOINT))
    assert rubric == [("taskset.task.judges.0", "http://127.0.0.1:9/v1", "policy", "PRIME_JUDGE_API_KEY")]
    assert in_code == [("taskset.task.judge", "http://127.0.0.1:9/v1", "policy", "PRIME_JUDGE_API_KEY")]
    # off: the environment's own endpoint (verifiers' hosted default for the plugged rubric)
    (own,) = env_judges(env_config_data(EnvConfig(id="vf-rubric")))
    assert own[2] == "openai/gpt-6-luna"


def test_the_judge_endpoint_defaults_to_the_policy_server():
    client = ClientConfig(base_url="http://127.0.0.1:8123/v1")
    ep = judge_endpoint(JudgeEndpointConfig(), client, "tiny")
    assert (ep.base_url, ep.model) == ("http://127.0.0.1:8123/v1", "tiny")
    assert judge_endpoint(JudgeEndpointConfig(enabled=False), client, "tiny") is None
    ext = judge_endpoint(JudgeEndpointConfig(base_url="http://judge:1/v1", model="j", api_key_var="K"), client, "t")
    assert (ext.base_url, ext.model, ext.api_key_var) == ("http://judge:1/v1", "j", "K")
    with pytest.raises(ValueError, match="judge.model is required"):
        JudgeEndpointConfig(base_url="http://judge:1/v1")


def test_a_judge_endpoint_that_does_not_answer_is_one_line_at_start():
    spec = EnvServerSpec(name="graded", env_config=env_config_data(EnvConfig(id="vf-rubric"), ENDPOINT))
    with pytest.raises(JudgeUnreachable) as e:
        asyncio.run(check_judges([spec], timeout=5))
    message = str(e.value)
    assert "\n" not in message and "http://127.0.0.1:9/v1" in message and "env graded" in message
    assert "taskset.task.judges.0" in message


def test_misspelt_or_mistyped_env_args_end_orchestrator_and_eval_at_start_in_one_line(capsys, tmp_path):
    """A typo in ``args`` used to be a 30-line pydantic traceback from the orchestrator's setup, after inference was
    up; now both entry points exit 2 before any server is contacted, naming the key and the field it resembles."""
    from pathlib import Path

    from prime_orchestrator.entrypoints import eval as eval_cli
    from prime_orchestrator.entrypoints import orchestrator as orchestrator_cli

    model = ["--model.name", str(Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "model")]
    typo = ["--env", '[{"id": "reverse-text", "args": {"num_exampels": 5}}]']
    orchestrator = ["--output-dir", str(tmp_path)]
    for main, extra in ((eval_cli.main, []), (eval_cli.main, ["--dry-run"]), (orchestrator_cli.main, orchestrator),
                        (orchestrator_cli.main, [*orchestrator, "--dry-run"])):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([*model, *typo, *extra])
        assert exc.value.code == 2
        assert capsys.readouterr().err == (
            "error: env.0 (reverse-text): args.num_exampels: Extra inputs are not permitted "
            "(did you mean 'num_examples'?)\n"
        )
    with pytest.raises(SystemExit):
        eval_cli.main([*model, "--env", '[{"id": "reverse-text", "env_args": {"bogus": 1}}]'])
    assert capsys.readouterr().err == "error: env.0 (reverse-text): env_args.bogus: Extra inputs are not permitted\n"


def test_a_taskset_whose_extra_is_not_installed_ends_eval_at_start_in_one_line(capsys, monkeypatch):
    """verifiers' textarena taskset without ``verifiers[ta]`` raises ImportError on import; that used to be a
    40-line traceback (exit 1) out of the settings check."""
    import sys
    from pathlib import Path

    from prime_orchestrator.entrypoints import eval as eval_cli

    for name in [m for m in sys.modules if m.startswith("verifiers.v1.tasksets.textarena")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "textarena", None)  # as if not installed
    model = ["--model.name", str(Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "model")]
    with pytest.raises(SystemExit) as exc:
        eval_cli.main([*model, "--env", '[{"id": "textarena", "args": {"game": "Hangman-v0"}}]'])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "error: env.0 (textarena): ImportError: textarena requires nltk and textarena. "
        "Install with: uv add 'verifiers[ta]'\n"
    )
