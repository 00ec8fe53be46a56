"""verifiers' own tasksets (``verifiers.v1.tasksets``) named by id, as a verifiers user would with ``vf-eval
<id>``, under our ``eval`` and two orchestrator steps. Of the four, textarena runs offline (docs/environments.md,
"verifiers' built-in tasksets", says why the others cannot run here):

- textarena, seeded TextArena word games: the game engine plays the user. Hangman-v0 on a four-word NLTK ``words``
  corpus the tests ship (``tests/fixtures/nltk_data``; ``nltk.download`` needs the internet). A scripted policy
  guesses the letters of ``LETTERS`` in order; the test replays each seed's game on the engine host-side, so every
  turn count, board and reward is the engine's own.
- openenv, an OpenEnv server's environment: the tests serve one of their own (``tests/fixtures/openenv_word.py``,
  openenv's server framework) and name it by ``base_url``. openenv is not in the dev group (it brings gradio and
  pandas): ``uv run --with openenv==0.4.1 --with mcp==2.0.0 pytest -m slow tests/environments/test_vf_tasksets.py``
  runs it (verifiers pins mcp 2.0.0; a newer openenv would pull mcp 1.x, and verifiers' tasksets stop importing).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.environments.test_vf_kinds import our_eval
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.orchestrator.test_vf_envs import decode, orchestrate, samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NLTK_DATA = Path(__file__).resolve().parents[1] / "fixtures" / "nltk_data"
LETTERS = "EATRUSONLIC"
HANGMAN = {"id": "textarena", "args": {"game": "Hangman-v0"}}


def script(prompt: str) -> str | None:
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "it has 4 letters" in last_user:  # the OpenEnv word game's hint after a miss
        return "pear"
    if "Say the secret word" in last_user:
        return "apple"
    if "You are playing Hangman" not in prompt:
        return None
    return f"I guess [{LETTERS[prompt.count('<|im_start|>assistant') - 1]}]"


def engine_game(seed: int) -> tuple[str, int, float]:
    """(target word, moves until the game ends, reward) of the scripted policy on seed ``seed``, from the engine."""
    import random

    import textarena as ta

    random.seed(seed)
    game = ta.make(env_id="Hangman-v0")
    game.reset(num_players=1)
    for moves, letter in enumerate(LETTERS, 1):
        game.step(f"I guess [{letter}]")
        if game.state.done:
            return game.state.game_state["target_word"], moves, float(game.state.rewards[0])
    raise AssertionError(f"seed {seed}: the game did not end")


@pytest.fixture
def nltk_data(monkeypatch):
    """The shipped corpus, here (nltk read NLTK_DATA when first imported) and in every env server."""
    nltk = pytest.importorskip("nltk")
    pytest.importorskip("textarena")
    monkeypatch.setenv("NLTK_DATA", str(NLTK_DATA))
    monkeypatch.setattr(nltk.data, "path", [str(NLTK_DATA), *nltk.data.path])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tasksets_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def test_textarena_task_i_is_the_board_the_engine_seeded_with_i(nltk_data):
    from prime_core.config.orchestrator import EnvConfig
    from prime_orchestrator.envs import TaskStream, server_spec

    spec = server_spec(EnvConfig.model_validate(HANGMAN))
    tasks = TaskStream(spec.env_config, spec.name)
    for seed in (0, 1):
        task = tasks.task_data(seed)
        assert task["info"] == {"game": "Hangman-v0", "seed": seed}
        columns = " ".join(f"C{i:02}" for i in range(len(engine_game(seed)[0])))
        assert f"{columns}\n" in task["prompt"] and "You are playing Hangman" in task["prompt"]
    # no harness of its own: unset, verifiers' default bash agent, as under vf-eval; `harness = "null"` is the
    # in-process chat loop
    assert spec.env_config["player"]["harness"] is None and spec.env_config["player"]["runtime"]["type"] == "subprocess"
    chat = server_spec(EnvConfig.model_validate({**HANGMAN, "harness": "null"}))
    assert chat.env_config["player"]["harness"]["id"] == "prime-chat"


@pytest.mark.slow  # two env servers and twelve game turns per run: minutes on 2 cores
def test_textarena_engine_plays_the_user_scores_the_game_and_trains_the_moves(server, tmp_path, nltk_data):
    games = {seed: engine_game(seed) for seed in range(4)}
    assert games[0] == ("rat", 4, 1.0) and games[1] == ("quiz", 7, 0.25)  # a win and a partial loss
    env = {**HANGMAN, "harness": "null"}  # a chat game: no bash tools in the prompt (auto is verifiers' bash)
    summary, rows = our_eval(tmp_path, server, env)
    assert summary["failed"] == 0 and summary["num_examples"] == 2
    for row in rows:
        word, moves, reward = games[row["example"]]  # example i is the engine seeded with i
        assert (row["num_turns"], row["reward"], row["metrics"]) == (moves, reward, {"reward/game_reward": reward})
        assert row["traces"] == [["player", reward]]
        # each move is answered by the engine's board as the user's turn
        assert row["completion"].count("[user]") == moves - 1 and row["completion"].count("[assistant]") == moves
    seed0 = [r["completion"] for r in rows if r["example"] == 0]
    assert len(seed0) == 2 and seed0[0] == seed0[1]  # the seed reproduces the episode
    assert re.search(r"\[user\] C00 C01 C02\n\s+_\s+A\s+_", seed0[0])  # 'rat' after E (miss) and A (hit)

    m = orchestrate(tmp_path / "run", server.config.model.name, server.url, env, seq_len=2048)
    assert m["reward/mean"] == (games[0][2] + games[1][2]) / 2 and m["samples/trained"] == 4
    assert m["num_turns/mean"] == (games[0][1] + games[1][1]) / 2
    for ids, mask, lps in samples(tmp_path / "run"):
        moves = decode(server, ids[mask]).count("<|im_end|>")
        # only the assistant's moves train, one per turn, in order; the engine's boards are in the sample, masked
        assert decode(server, ids[mask]) == "".join(f"I guess [{c}]<|im_end|>" for c in LETTERS[:moves])
        assert "You are playing Hangman" in decode(server, ids[~mask]) and "C00" in decode(server, ids[~mask])
        assert (lps[mask] < 0).all() and (lps[~mask] == 0).all()
    step1 = (tmp_path / "run" / "samples" / "orchestrator_step_1.jsonl").read_text()
    assert sorted({int(x) for x in re.findall(r'"example": (\d+)', step1)}) == [2, 3]  # the next seeds


@pytest.mark.slow  # CI holds the same with stand-ins (tests/orchestrator/test_eval_cli.py)
def test_eval_of_a_taskset_whose_every_rollout_fails_ends_in_one_line(server, tmp_path, monkeypatch, capsys):
    """verifiers' openenv taskset imports ``openenv`` in each rollout: without ``verifiers[openenv]`` every rollout
    failed and ``eval`` printed a table of reward 0.0000 and exited 0. Now it still writes the results, then exits 1
    with one line naming the env and an error."""
    from prime_orchestrator.entrypoints import eval as eval_cli

    missing = tmp_path / "missing" / "openenv"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'openenv'\", name='openenv')\n")
    monkeypatch.setenv("PYTHONPATH", str(missing.parent))  # as if not installed, in the env server
    env = {"id": "openenv", "args": {"base_url": "http://127.0.0.1:9", "resets": [{}, {}]}, "harness": "null"}
    with pytest.raises(SystemExit) as exc:
        eval_cli.main(["--model.name", server.config.model.name, "--client.base-url", server.url, "--env",
                       json.dumps([env]), "--num-examples", "2", "--rollouts-per-example", "1",
                       "--output-dir", str(tmp_path / "out"), "--sampling.max-tokens", "8"])  # fmt: skip
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: env openenv (base): all 2 rollouts failed, e.g. ") and "openenv" in err[40:], err
    rows = json.loads((tmp_path / "out" / "eval" / "base" / "openenv.json").read_text())["rollouts"]
    assert [r["failed"] for r in rows] == [True, True]  # the results are written first


@pytest.mark.slow  # skipped without openenv, which the dev group leaves out
def test_openenv_server_plays_the_user_its_rewards_summed_the_actions_trained(server, tmp_path):
    pytest.importorskip("openenv")
    from tests.fixtures.openenv_word import serve

    url, openenv_server = serve()
    try:
        # pear: a miss ("apple") answered with the server's hint, then the hit; apple: a hit at once
        env = {"id": "openenv", "args": {"base_url": url, "resets": [{"word": "pear"}, {"word": "apple"}]},
               "harness": "null"}  # fmt: skip
        summary, rows = our_eval(tmp_path, server, env)
        turns = {r["example"]: (r["num_turns"], r["reward"], r["metrics"]) for r in rows}
        assert turns == {0: (2, 1.0, {"reward/openenv_reward": 1.0}), 1: (1, 1.0, {"reward/openenv_reward": 1.0})}
        first = json.loads(rows[0]["prompt"].removeprefix("[user] "))  # the observation and the action schema
        assert first["observation"]["text"] == "Say the secret word. It starts with p."
        assert first["action_schema"]["required"] == ["message"]
        assert "[user] {" in next(r["completion"] for r in rows if r["example"] == 0)  # the hint as the user's turn
        m = orchestrate(tmp_path / "run", server.config.model.name, server.url, env, seq_len=2048)
        assert m["reward/mean"] == 1.0 and m["samples/trained"] == 4 and m["num_turns/mean"] == 1.5
        trained = sorted(decode(server, ids[mask]) for ids, mask, _ in samples(tmp_path / "run"))
        assert trained == ["apple<|im_end|>"] * 2 + ["apple<|im_end|>pear<|im_end|>"] * 2  # only the actions train
    finally:
        openenv_server.should_exit = True


@pytest.mark.slow  # an env server process: verifiers imported in a fresh interpreter
def test_an_env_whose_start_raises_is_one_line_naming_the_cause(tmp_path):
    """verifiers' nemo_gym Env needs ``args.task.resources_url`` (a NeMo Gym resource server) unless a taskset
    subclass names a server to launch; its ``start`` raises in the env server. That was two tracebacks and
    ``RuntimeError: env server nemo_gym did not become healthy (exit code 1)`` out of ``eval``; now the cause is on the
    one line ``eval`` and the orchestrator print (EnvServerFailed)."""
    import asyncio

    from prime_core.config.orchestrator import EnvConfig
    from prime_orchestrator.env_server import EnvServer, EnvServerFailed
    from prime_orchestrator.envs import server_spec

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"responses_create_params": {"input": [{"role": "user", "content": "Say hi."}]}}\n')
    spec = server_spec(EnvConfig.model_validate({"id": "nemo_gym", "args": {"dataset": str(rows)}, "harness": "null"}))
    with pytest.raises(EnvServerFailed) as e:
        asyncio.run(EnvServer(spec).start())
    assert str(e.value) == (
        "env server nemo_gym exited with code 1 while starting: ValueError: set --env.taskset.task.resources-url"
    )
