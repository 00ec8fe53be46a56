"""``evaluate_env`` against environments that misbehave: a scoring function that returns NaN or infinity must not
turn the environment's whole summary (and ``results.json``) into NaN; the rollout counts as failed, as in training."""

from __future__ import annotations

import asyncio
import json
import math

from prime_core.schemas.rollout import RolloutResult
from prime_orchestrator.evals import evaluate_env
from prime_orchestrator.metric_keys import MetricKeyCap

from tests.orchestrator.test_eval_cli import stub_envs


class FakeRunner:
    """Rollout ``i`` scores ``rewards[i]`` (``metrics[i]`` recorded with it)."""

    def __init__(self, rewards: list[float], metrics: list[dict] | None = None):
        self.rewards, self.metrics = rewards, metrics or [{} for _ in rewards]
        self.num_examples = len(rewards)
        self.name, self.metric_keys = "e", MetricKeyCap()

    async def rollout(self, example, *, client, model, sampling):
        return RolloutResult(
            env="e",
            example=example,
            reward=self.rewards[example],
            metrics=self.metrics[example],
            prompt=f"prompt {example}",
            completion=f"completion {example}",
            num_turns=1,
        )


def _evaluate(runner: FakeRunner):
    return asyncio.run(
        evaluate_env(
            runner,
            client_for=lambda i: None,
            model="m",
            num_examples=runner.num_examples,
            rollouts_per_example=1,
            sampling=type("S", (), {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8})(),
            seed=0,
        )
    )


def test_a_non_finite_reward_fails_its_rollout_and_the_summary_stays_finite():
    summary, rows = _evaluate(FakeRunner([1.0, math.nan, 0.0, math.inf]))
    # The other rollouts still measure something: mean over all four, the two bad ones scoring 0.
    assert summary["reward/mean"] == 0.25 and summary["failed"] == 2
    assert [r["failed"] for r in rows] == [False, True, False, True]
    assert "not finite: reward = nan" in rows[1]["error"] and rows[1]["reward"] == 0.0
    assert rows[1]["completion"] == "completion 1"  # kept, to see what was scored
    json.dumps({"summary": summary, "rollouts": rows}, allow_nan=False)  # results.json stays standard JSON


def test_a_non_finite_metric_fails_its_rollout_and_leaves_the_rows_standard_json():
    summary, rows = _evaluate(FakeRunner([1.0, 1.0], [{"acc": 1.0}, {"acc": -math.inf}]))
    assert summary["reward/mean"] == 0.5 and summary["failed"] == 1
    assert "acc = -inf" in rows[1]["error"]
    json.dumps({"summary": summary, "rollouts": rows}, allow_nan=False)


def test_an_eval_env_naming_a_new_metric_per_rollout_logs_at_most_the_cap_over_its_evals():
    """Eval summaries were not capped: each periodic eval of such an env added a metrics.jsonl / W&B column per rollout
    (``eval/<env>/metrics/<name>``), 200 after two evals of 100 rollouts; now 64 over the runner's evals."""
    from prime_core.schemas.rollout import TraceResult

    class Named(FakeRunner):
        async def rollout(self, example, **kwargs):
            r = await super().rollout(example, **kwargs)
            return r.model_copy(update={"traces": [TraceResult(seat="a", reward=1.0, metrics=r.metrics)]})

    runner = Named([1.0] * 100)
    names: set[str] = set()
    for round in range(2):
        runner.metrics = [{f"answer_{round}_{i}": 1.0} for i in range(100)]
        summary, _ = _evaluate(runner)
        names |= {k for k in summary if k.startswith("metrics/")}
    assert len(names) == 64 and summary["metrics_dropped"] == 100 and summary["reward/mean"] == 1.0


def test_a_server_that_dies_before_a_checkpoint_loads_is_one_line_and_keeps_the_scores_so_far(
    tmp_path, monkeypatch, capsys
):
    """The server answered for ``base``, then died: loading ``step_1`` fails. It was a traceback (WeightUpdateError),
    and results.json/results.txt, written only at the end, never held the base scores."""
    import pytest
    from prime_core.io import mark_stable
    from prime_orchestrator.entrypoints.eval import main

    from tests.orchestrator.test_eval_cli import MODEL
    from tests.tiny import free_port

    stub_envs(monkeypatch)
    (tmp_path / "weights" / "step_1").mkdir(parents=True)
    mark_stable(tmp_path / "weights" / "step_1")  # complete weights (eval waits for a step still being written)
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["--model.name", str(MODEL), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path / "out")]
    args += ["--weights-dir", str(tmp_path / "weights"), "--steps", "1", "--client.base-url", dead]
    with pytest.raises(SystemExit) as e:
        main([*args, "--client.max-retries", "0"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: inference server {dead} failed to load weights step 1"), line
    assert "step_1" in line and "base" in line  # what was not scored, and what was
    out = tmp_path / "out" / "eval"
    assert json.loads((out / "results.json").read_text()) == {"base": {"reverse-text": json.loads(
        (out / "base" / "reverse-text.json").read_text())["summary"]}}  # fmt: skip
    assert "step_1" not in (out / "results.txt").read_text() and "base" in (out / "results.txt").read_text()


def test_rollouts_that_failed_mid_eval_show_in_the_table_and_a_warning(tmp_path, monkeypatch, caplog):
    """The server died halfway: half the rollouts failed and scored 0. The table showed only the halved mean."""
    from prime_orchestrator.entrypoints.eval import main

    from tests.orchestrator.test_eval_cli import MODEL

    async def half_failed(runner, **kwargs):
        rows = [{"example": 0, "failed": False, "reward": 1.0, "error": None},
                {"example": 1, "failed": True, "reward": 0.0, "error": "ConnectError: All connection attempts failed"}]  # fmt: skip
        summary = {"reward/mean": 0.5, "reward/std": 0.5, "num_examples": 2, "rollouts_per_example": 1, "failed": 1}
        return summary, rows

    stub_envs(monkeypatch, half_failed)
    main(["--model.name", str(MODEL), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path)])
    header, _, row = (tmp_path / "eval" / "results.txt").read_text().splitlines()
    assert header.split()[:4] == ["weights", "env", "n", "failed"] and row.split()[:4] == [
        "base",
        "reverse-text",
        "2",
        "1",
    ]
    assert "env reverse-text (base): 1 of 2 rollouts failed (scored 0), e.g. ConnectError" in caplog.text


def test_a_full_disk_under_the_results_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """The output directory filled up mid-eval: a traceback (OSError from atomic_write_json)."""
    import errno
    import os

    import pytest
    from prime_orchestrator import eval_runner
    from prime_orchestrator.entrypoints.eval import main

    from tests.orchestrator.test_eval_cli import MODEL

    def full(path, obj, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) + ".tmp")

    stub_envs(monkeypatch)
    monkeypatch.setattr(eval_runner, "atomic_write_json", full)
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(MODEL), "--environment-ids", "reverse-text", "--output-dir", str(tmp_path)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line == f"error: No space left on device (errno 28 ENOSPC) writing {tmp_path}/eval/base/weights.json.tmp"


def test_an_eval_of_other_weights_into_the_same_directory_is_refused_before_it_overwrites(
    tmp_path, monkeypatch, capsys
):
    """Two evals of different models with the default --output-dir: the second silently overwrote the first's
    eval/base/<env>.json and results.json. It is one line naming the directory and both, exit 2, nothing touched; the
    same weights again (a re-run) still overwrite."""
    import shutil

    import pytest
    from prime_orchestrator.entrypoints.eval import main

    from tests.orchestrator.test_eval_cli import MODEL

    stub_envs(monkeypatch)
    other = tmp_path / "other-model"
    shutil.copytree(MODEL, other)
    out = tmp_path / "out"
    args = ["--environment-ids", "reverse-text", "--output-dir", str(out)]
    main(["--model.name", str(MODEL), *args])
    first = (out / "eval" / "base" / "reverse-text.json").read_text()
    with pytest.raises(SystemExit) as e:
        main(["--model.name", str(other), *args])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out / 'eval' / 'base'} holds the eval of model {MODEL}, not model {other}"), line
    assert "--output-dir" in line
    assert (out / "eval" / "base" / "reverse-text.json").read_text() == first
    main(["--model.name", str(MODEL), *args])  # the same weights again: a re-run
