"""``eval/<label>/weights.json`` compared model names as strings: the same weights named another way (a trailing
slash, a symlink, a relative path, a hub id and its cached snapshot) were refused (exit 2), and other weights under
the same name (a relative path from another directory, a model directory whose weights were replaced) were accepted,
their eval overwriting the earlier one's files. Names are now resolved to the files they load."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.orchestrator.test_eval_cli import MODEL, stub_envs


def run(out, model: str) -> int:
    """``eval`` of ``model`` into ``out`` (None: no ``--output-dir``)."""
    from prime_orchestrator.entrypoints.eval import main

    try:
        main(["--model.name", model, "--environment-ids", "reverse-text", *(["--output-dir", str(out)] if out else [])])
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture
def model(tmp_path, monkeypatch):
    stub_envs(monkeypatch)
    path = tmp_path / "models" / "m"
    shutil.copytree(MODEL, path)
    return path


def test_the_same_model_named_another_way_is_the_same_weights(tmp_path, model, monkeypatch, capsys):
    out = tmp_path / "out"
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert run(out, str(model)) == 0
    for name in (f"{model}/", str(tmp_path / "link"), "models/m", "./link/"):
        assert run(out, name) == 0, (name, capsys.readouterr().err)


def test_a_hub_id_and_its_cached_snapshot_are_the_same_weights(tmp_path, model, monkeypatch, capsys):
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(model, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    assert run(out, "org/tiny") == 0
    assert run(out, str(snapshot)) == 0, capsys.readouterr().err
    record = json.loads((out / "eval" / "base" / "weights.json").read_text())
    assert record["model"] == str(snapshot) and record["model_path"] == str(snapshot.resolve())


def test_other_weights_under_the_same_name_are_refused(tmp_path, model, monkeypatch, capsys):
    """The same relative name from another directory, and a directory whose weights were replaced: other weights."""
    out = tmp_path / "out"
    other = tmp_path / "elsewhere" / "models" / "m"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    monkeypatch.chdir(tmp_path)
    assert run(out, "models/m") == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run(out, "models/m") == 2  # before: the same string, accepted, and the first eval's files overwritten
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out / 'eval' / 'base'} holds the eval of model models/m, not model models/m")
    shutil.rmtree(model)
    shutil.copytree(other, model)  # the first model's directory, its weights replaced
    monkeypatch.chdir(tmp_path)
    assert run(out, "models/m") == 2


def test_other_weights_are_refused_before_the_environments_are_checked(tmp_path, model, monkeypatch, capsys):
    """The quickstart's second `eval` of other weights into the default `outputs`: the refusal took the environments'
    check first (verifiers' imports: 9 s on a loaded 2-core VM; 1.3 s now)."""
    import prime_orchestrator.env_config as env_config

    out = tmp_path / "out"
    assert run(out, str(model)) == 0
    other = tmp_path / "other"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    capsys.readouterr()

    def checked_first(*args, **kwargs):
        raise AssertionError("the environments were checked before the output directory")

    monkeypatch.setattr(env_config, "check_envs", checked_first)
    assert run(out, str(other)) == 2
    assert "holds the eval of model" in capsys.readouterr().err


def test_evals_of_two_models_without_an_output_dir_each_get_their_own(tmp_path, model, monkeypatch, capsys):
    """Before: every eval without ``--output-dir`` wrote into ``outputs/`` itself (beside an ``rl`` run there), and
    the second model's was refused as one that would overwrite the first's (exit 2). Now each has its own
    ``outputs/<model>-eval``; another model's eval into a directory given by hand is still refused."""
    other = tmp_path / "other" / "m"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    monkeypatch.chdir(tmp_path)
    assert run(None, str(model)) == 0
    assert run(None, str(other)) == 0, capsys.readouterr().err
    first, second = tmp_path / "outputs" / "models-m-eval", tmp_path / "outputs" / "other-m-eval"
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [first.name, second.name]
    for out, scored in ((first, model), (second, other)):
        assert json.loads((out / "eval" / "base" / "weights.json").read_text())["model"] == str(scored)
        assert (out / "eval" / "results.json").is_file()
    capsys.readouterr()
    assert run(first, str(other)) == 2
    assert f"{first / 'eval' / 'base'} holds the eval of model {model}, not model {other}" in capsys.readouterr().err


def test_ctrl_c_of_an_eval_says_what_was_scored(tmp_path, model, monkeypatch, capsys):
    """Ctrl-C during the second checkpoint's eval: exit 130 and one line naming the weights scored in full (the
    results file holds them); before, eval exited 130 without a word."""
    from tests.orchestrator.test_eval_cli import stub_envs

    calls = []

    async def second_interrupted(runner, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"reward/mean": 0.5, "reward/std": 0.5, "num_examples": 2, "rollouts_per_example": 1, "failed": 0}, []

    stub_envs(monkeypatch, evaluate=second_interrupted)
    out = tmp_path / "out"
    assert run(out, str(model)) == 0
    capsys.readouterr()
    calls.clear()
    weights = tmp_path / "w"
    for step in (1, 2):
        shutil.copytree(model, weights / f"step_{step}")
        (weights / f"step_{step}" / "STABLE").write_text("")
    monkeypatch.setattr("prime_orchestrator.eval_runner.inference.update_weights", _nothing)
    from prime_orchestrator.entrypoints.eval import main

    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(model), "--environment-ids", "reverse-text", "--output-dir", str(out),
              "--weights-dir", str(weights), "--steps", "1,2"])  # fmt: skip
    assert e.value.code == 130
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == f"eval: interrupted (SIGINT); weights scored in full before it: base ({out}/eval/results.json)"


async def _nothing(*args, **kwargs):
    pass
