"""An environment's taskset that cannot give a task (fails to build, is empty, ends early, raises on a row) stops the
orchestrator and eval with one line naming the environment and the task, exit 2; never a traceback or an unrelated
``RuntimeError: coroutine raised StopIteration``."""

from __future__ import annotations

import asyncio

import pytest
from prime_core.config.orchestrator import EnvConfig
from prime_orchestrator.envs import TasksetError, TaskStream, server_spec

from tests.fixtures.vf import use_vf_envs
from tests.trainer.trainer_utils import write_char_tokenizer


def stream(env_id: str, args: dict) -> TaskStream:
    spec = server_spec(EnvConfig.model_validate({"id": env_id, "args": args}))
    return TaskStream(spec.env_config, spec.name)


def test_bounded_taskset_that_fails_to_load_or_is_empty():
    with pytest.raises(TasksetError, match=r"env reverse-text: taskset 'reverse-text' has no tasks"):
        stream("reverse-text", {"num_examples": 0})
    with pytest.raises(TasksetError, match=r"env reverse-text: its taskset 'reverse-text' failed to load \(ValueError"):
        stream("reverse-text", {"min_chars": 30, "max_chars": 2})


def test_infinite_taskset_that_ends_or_raises_names_the_task(monkeypatch):
    use_vf_envs(monkeypatch)
    tasks = stream("vf-bad-rows", {"good": 2, "after": "end"})
    assert tasks.task_data(1)["prompt"] == "Say 1."

    async def ask(index: int):  # as EnvRunner.rollout asks, inside a coroutine
        return tasks.task_data(index)

    with pytest.raises(
        TasksetError, match=r"env vf-bad-rows: the infinite taskset ended after 2 tasks \(task 5 asked\)"
    ):
        asyncio.run(ask(5))
    tasks = stream("vf-bad-rows", {"good": 1, "after": "raise"})
    with pytest.raises(TasksetError, match=r"env vf-bad-rows: task 1 failed to load \(ValueError: row 1: 'prompt'"):
        asyncio.run(ask(3))


@pytest.mark.parametrize("entry", ["orchestrator", "eval"])
def test_entry_points_report_a_taskset_error_in_one_line(entry, monkeypatch, capsys, tmp_path):
    async def broken(*_args, **_kwargs):
        raise TasksetError("env x: task 3 failed to load (ValueError: bad row)")

    if entry == "orchestrator":
        from prime_orchestrator.entrypoints.orchestrator import run

        class Orch:
            run = staticmethod(broken)

        with pytest.raises(SystemExit) as e:
            run(Orch(), tmp_path)
    else:
        import prime_orchestrator.eval_runner as eval_runner
        from prime_orchestrator.entrypoints.eval import main

        monkeypatch.setattr(eval_runner, "run_eval", broken)
        model = write_char_tokenizer(tmp_path / "model")
        (model / "config.json").write_text('{"model_type": "qwen3"}')
        monkeypatch.setattr("prime_orchestrator.entrypoints.eval._check_env_settings", lambda config: None)
        with pytest.raises(SystemExit) as e:
            main(["--model.name", str(model), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1] == "error: env x: task 3 failed to load (ValueError: bad row)"
    )


def test_a_missing_nltk_corpus_is_named_in_the_reason(tmp_path):
    """verifiers' textarena word games read NLTK's ``words`` corpus, which an offline host lacks (nltk.download
    fails). nltk frames the LookupError's message in rows of '*': the one-line reason was
    ``LookupError: ... ****...``, naming nothing."""
    import nltk
    from prime_orchestrator.envs import _reason

    with pytest.raises(LookupError) as e:
        nltk.data.find("corpora/words", paths=[str(tmp_path)])
    reason = _reason(e.value)
    assert reason.startswith("LookupError: Resource 'words' not found. ... ") and "*" not in reason


def test_an_infinite_taskset_keeps_a_bounded_number_of_drawn_tasks(monkeypatch):
    """Every task drawn from an infinite taskset was kept for the whole run (memory grew with the steps); now the
    last ``RETAINED_TASKS`` asked are kept, and an older one asked again is drawn again, the same task."""
    import gc

    import prime_orchestrator.envs as envs

    use_vf_envs(monkeypatch)
    monkeypatch.setattr(envs, "RETAINED_TASKS", 8, raising=False)
    tasks = stream("vf-infinite", {})

    def alive() -> int:
        gc.collect()
        return sum(type(o).__name__ == "CountTask" for o in gc.get_objects())

    for i in range(200):
        assert tasks.task_data(i)["prompt"] == f"What number comes after {i}?"
        assert tasks.task_data(max(0, i - 3))["prompt"] == f"What number comes after {max(0, i - 3)}?"  # a retry
    assert tasks.task_data(5)["prompt"] == "What number comes after 5?"  # long gone: drawn again
    assert tasks.task_data(1000)["prompt"] == "What number comes after 1000?"  # a resume's cursor
    assert alive() <= 8 + 2 and len(tasks) == 1001  # 1002 before (the taskset may hold the one it just gave)
