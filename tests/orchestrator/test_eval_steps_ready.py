"""``eval --steps N`` on a checkpoint still being written (its directory there, its STABLE marker not yet): the base
model was scored first (minutes on a real model), then the eval failed at that step's load. Every requested step is
now checked before anything is scored: one still being written is waited for (``weights_timeout``), one that never
completes stops the eval in one line with nothing scored."""

from __future__ import annotations

import json

import pytest
from prime_core.io import mark_stable

from tests.orchestrator.test_eval_cli import MODEL, stub_envs
from tests.tiny import free_port


def eval_args(tmp_path, *extra: str) -> list[str]:
    args = ["--model.name", str(MODEL), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path / "out")]
    return [*args, "--weights-dir", str(tmp_path / "weights"), "--client.base-url", f"http://127.0.0.1:{free_port()}",
            "--client.max-retries", "0", *extra]  # fmt: skip


def test_a_step_that_never_completes_stops_the_eval_before_the_base_is_scored(tmp_path, monkeypatch, capsys):
    from prime_orchestrator.entrypoints.eval import main

    stub_envs(monkeypatch)
    (tmp_path / "weights" / "step_1").mkdir(parents=True)  # being written: no STABLE (and it never comes)
    (tmp_path / "weights" / "step_2").mkdir()
    mark_stable(tmp_path / "weights" / "step_2")
    with pytest.raises(SystemExit) as e:
        main(eval_args(tmp_path, "--steps", "2,1", "--weights-timeout", "0.5"))
    assert e.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"error: --steps: step_1 under {tmp_path / 'weights'} has no STABLE marker after 0.5s (weights_timeout): a "
        "checkpoint still being written, or an incomplete copy; nothing was scored"
    )
    assert not (tmp_path / "out" / "eval" / "base").exists()  # before: base scored, then the load of step_1 failed


def test_a_step_being_written_is_waited_for_and_scored(tmp_path, monkeypatch, caplog):
    from prime_orchestrator import eval_runner
    from prime_orchestrator.entrypoints.eval import main

    stub_envs(monkeypatch)
    step = tmp_path / "weights" / "step_3"
    step.mkdir(parents=True)
    loads = []

    async def update_weights(urls, weight_dir, step, **kwargs):
        loads.append(step)

    warning = eval_runner.logger.warning

    def trainer_finishes(msg, *args, **kwargs):
        warning(msg, *args, **kwargs)
        if msg.startswith("waiting up to"):  # the trainer writes STABLE while the eval waits
            mark_stable(step)

    monkeypatch.setattr(eval_runner.inference, "update_weights", update_weights)
    monkeypatch.setattr(eval_runner.logger, "warning", trainer_finishes)
    main(eval_args(tmp_path, "--steps", "3"))
    assert loads == [3]
    results = json.loads((tmp_path / "out" / "eval" / "results.json").read_text())
    assert set(results) == {"base", "step_3"}
    assert any(
        "waiting up to 120s (weights_timeout) for the STABLE marker of step_3" in r.getMessage() for r in caplog.records
    )
