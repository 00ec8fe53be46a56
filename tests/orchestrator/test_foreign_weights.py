"""Weights in the output directory that this launch's trainer did not publish: a hand-run orchestrator resumed
without `prime-launch rewind` (a stopped launch's later steps), or another run's weights, were relayed as this run's
policy (the newest of them, at the first poll). Now refused before anything starts, in one line naming the directory
and the way out; a resume that was rewound, an orchestrator started before its trainer, and a trainer started first
under one exported PRIME_RUN_ID still run."""

from __future__ import annotations

import asyncio
import json

import pytest
from prime_core.io import mark_stable
from prime_core.run_dir import WEIGHTS_RUN_FILE, RunDir
from prime_orchestrator import orchestrator as orch_module
from prime_orchestrator.orchestrator import Orchestrator
from prime_orchestrator.weight_relay import ForeignWeights

from tests.orchestrator.test_curriculum import NUM_EXAMPLES, config


def publish(run_dir: RunDir, step: int, run_id: str | None) -> None:
    """What a trainer leaves as ``weights/step_N`` (stamped with its launch's id)."""
    path = run_dir.weight_step(step)
    path.mkdir(parents=True)
    (path / WEIGHTS_RUN_FILE).write_text(json.dumps({"run_id": run_id}))
    mark_stable(path)


class StubPool:
    spec = None

    def __init__(self, name: str):
        self.num_examples = NUM_EXAMPLES[name.split("/")[-1]]

    async def start(self) -> None:
        pass


def served(tmp_path, monkeypatch, *, resume_step: int | None, polls: int = 3) -> list[int]:
    """The weight steps an orchestrator sends inference through its start-up and ``polls`` polls of its relay."""
    c = config(tmp_path)
    c = c.model_copy(update={"ckpt": c.ckpt.model_copy(update={"resume_step": resume_step})})
    c.judge.check = False
    orch = Orchestrator(c)
    loads: list[int] = []

    async def load(step: int, source: str = "auto") -> None:
        loads.append(step)
        orch.policy.version = step

    async def healthy(*_args, **_kwargs) -> None:
        pass

    monkeypatch.setattr(orch.policy, "load", load)
    monkeypatch.setattr(orch_module.inference, "wait_healthy", healthy)
    monkeypatch.setattr(orch, "_runner", lambda env, name: StubPool(name))
    monkeypatch.setattr(orch_module, "report_env_servers", lambda pools: None)
    monkeypatch.setattr(orch_module, "build_monitor", lambda *a, **k: None)

    async def main() -> None:
        await orch.setup()
        watcher = asyncio.create_task(orch.policy.watch(poll_interval=0))
        for _ in range(polls):
            await asyncio.sleep(0)
        watcher.cancel()
        if not watcher.cancelled() and watcher.done() and watcher.exception():
            raise watcher.exception()

    asyncio.run(main())
    return loads


def checkpoint(tmp_path, step: int) -> None:
    orch = Orchestrator(config(tmp_path))
    orch.curriculum.start(NUM_EXAMPLES)
    orch._save_checkpoint(step)


@pytest.mark.parametrize("run_id", [None, "launch-b"])
def test_a_resume_without_rewind_refuses_the_stopped_runs_later_weights(tmp_path, monkeypatch, run_id):
    """Resumed at step 2 over weights 0-4 of the stopped launch: step 4 was served at the first poll."""
    monkeypatch.delenv("PRIME_RUN_ID", raising=False)
    if run_id:
        monkeypatch.setenv("PRIME_RUN_ID", run_id)
    run_dir = RunDir(tmp_path)
    for step in range(5):
        publish(run_dir, step, "launch-a")
    checkpoint(tmp_path, 2)
    with pytest.raises(ForeignWeights) as e:
        served(tmp_path, monkeypatch, resume_step=2)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{run_dir.weights} holds weights of steps 3, 4 after this ")
    assert f"prime-launch rewind --output-dir {tmp_path} --step 2" in line


def test_a_fresh_orchestrator_refuses_another_runs_weights(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIME_RUN_ID", raising=False)
    for step in range(3):
        publish(RunDir(tmp_path), step, None)
    with pytest.raises(ForeignWeights, match=r"holds weights of steps 1, 2 after this orchestrator's start step 0"):
        served(tmp_path, monkeypatch, resume_step=None)


def test_a_rewound_resume_serves_its_checkpoints_weights_and_then_the_trainers(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_RUN_ID", "launch-b")
    run_dir = RunDir(tmp_path)
    for step in range(3):
        publish(run_dir, step, "launch-a")  # the stopped launch's, up to the checkpoint: served again
    checkpoint(tmp_path, 2)
    assert served(tmp_path, monkeypatch, resume_step=2) == [2]


def test_a_trainer_started_first_under_the_same_run_id_is_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_RUN_ID", "pair")
    run_dir = RunDir(tmp_path)
    for step in range(2):
        publish(run_dir, step, "pair")
    assert served(tmp_path, monkeypatch, resume_step=None) == [1]


def test_weights_another_launch_publishes_mid_run_end_it(tmp_path, monkeypatch):
    """An orchestrator started first (nothing there) follows its own trainer; weights stamped by another launch that
    appear later end the run in one line instead of being served."""
    monkeypatch.setenv("PRIME_RUN_ID", "mine")
    run_dir = RunDir(tmp_path)
    publish(run_dir, 0, "mine")
    assert served(tmp_path, monkeypatch, resume_step=None) == []
    monkeypatch.setattr(Orchestrator, "setup", _setup_without_check)  # as if they appeared after the start-up
    publish(run_dir, 1, "mine")
    assert served(tmp_path, monkeypatch, resume_step=None) == [1]
    publish(run_dir, 2, "other")
    with pytest.raises(ForeignWeights, match=r"step_2 was published by launch 'other', this orchestrator's launch"):
        served(tmp_path, monkeypatch, resume_step=None)


def test_unstamped_weights_mid_run_end_a_launch_whose_trainer_stamps(tmp_path, monkeypatch):
    """Weights without ``run.json`` (a trainer started without PRIME_RUN_ID, or an older one, writing to this run's
    directory) appearing mid-run were served as this run's policy once this launch's trainer had stamped its own."""
    monkeypatch.setenv("PRIME_RUN_ID", "mine")
    run_dir = RunDir(tmp_path)
    publish(run_dir, 0, "mine")
    monkeypatch.setattr(Orchestrator, "setup", _setup_without_check)  # as if they appeared after the start-up
    publish(run_dir, 1, None)
    with pytest.raises(ForeignWeights) as e:
        served(tmp_path, monkeypatch, resume_step=None)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{run_dir.weight_step(1)} carries no launch id (run.json) while ")


def test_a_hand_started_pair_whose_trainer_stamps_nothing_is_followed(tmp_path, monkeypatch):
    """An orchestrator with PRIME_RUN_ID beside a trainer without one: no step carries the id, so the trainer's
    unstamped weights are this run's (as micro-batch files without an id are taken)."""
    monkeypatch.setenv("PRIME_RUN_ID", "mine")
    run_dir = RunDir(tmp_path)
    publish(run_dir, 0, None)
    monkeypatch.setattr(Orchestrator, "setup", _setup_without_check)
    publish(run_dir, 1, None)
    publish(run_dir, 2, None)
    assert served(tmp_path, monkeypatch, resume_step=None) == [2]


_real_setup = Orchestrator.setup


async def _setup_without_check(self) -> None:
    """Start-up as before the run, with the weights the trainer published since (the check is at start-up only)."""
    self.policy.refuse_later_weights = lambda start: None
    await _real_setup(self)
