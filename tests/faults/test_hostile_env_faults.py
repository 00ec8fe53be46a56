"""More hostile environments against the real orchestrator (tests/faults/test_env_faults.py has the first ones): a
reward that is -inf or not a number, a trace that holds what cannot be serialised (a lock) or 100 MB, an env turn of
messages in no chat schema, an env that asks for turns until the context is full, rewards that leave a thread or a
process of their own running, and an env answer of 100 MB. Each fails its rollout with a one-line reason (counted) or
is scored as played; nothing non-finite reaches a micro-batch, no process outlives the run, and each step ends in
bounded time."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from prime_core.schemas.microbatch import read_microbatches

from tests.faults.test_env_faults import fault_config, run_orchestrator, sample_errors, step_metrics
from tests.fixtures.vf import use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess"), pytest.mark.slow]

# 8 groups of 2 rollouts a step, every second task faulty: step 0 has inf, thread, text, child; step 1 the rest.
KINDS = "inf,thread,text,child,unserial,blob,schema,turns"
FAILING = {"inf": "not finite: reward = -inf", "text": "could not convert string to float: 'one'",
           "unserial": "Unable to serialize unknown type: <class '_thread.lock'>", "schema": "validation error"}  # fmt: skip


def daemons_since(ticks: int) -> list[int]:
    """The `child` fault's daemon `sleep`s started since ``ticks`` (clock ticks since boot) that still run."""
    from prime_orchestrator.proc_tree import command, start_time

    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [p for p in pids if command(p) == "sleep 3599" and (start_time(p) or 0) >= ticks]


def boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def finite_micro_batches(tmp_path) -> int:
    """How many micro-batches the run wrote; each asserted finite."""
    files = sorted((tmp_path / "rollouts").glob("step_*/rank_*.safetensors"))
    count = 0
    for path in files:
        _, mbs = read_microbatches(path)
        for mb in mbs:
            assert np.isfinite(mb.advantages).all() and np.isfinite(mb.inference_logprobs).all(), path
            count += 1
    return count


def test_hostile_rewards_traces_and_turns_fail_their_rollouts_in_one_line_and_leave_nothing(
    tmp_path, tiny_model, torch_server, monkeypatch
):
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, KINDS, every=2, batch_size=16,
                          recovery={"probe_timeout_s": 5, "min_ok_fraction": 0.25},
                          log_extras={"interval": 1, "num_samples": 16})  # fmt: skip
    started = boot_ticks()
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []  # the left-behind `sleep` and the thread's worker are gone with the server
    assert daemons_since(started) == []  # and the daemons that left its tree (before: adopted by init, left running)
    metrics = step_metrics(tmp_path)
    assert [metrics[s]["failed/vf-faults"] for s in (0, 1)] == [4, 4], metrics
    errors = sample_errors(tmp_path)
    for kind, reason in FAILING.items():
        assert sum(reason in e for e in errors) == 2, (kind, errors)
    assert all("\n" not in e for e in errors)
    assert finite_micro_batches(tmp_path) > 0
    assert took < 600
    print(f"{KINDS}: 2 steps in {took:.0f} s")


def test_an_env_answer_of_100_mb_ends_its_rollout_at_once_and_nothing_else(
    tmp_path, tiny_model, torch_server, monkeypatch
):
    """Before the prompt bound (`prime_orchestrator.prompt_bound`) the renderer tokenized the 100 MB in the env
    worker: both rollouts ran to their timeout (120 s here), failed, and held the worker's renderer past it."""
    use_vf_envs(monkeypatch)
    env = {"id": "vf-faults", "env_args": {"huge_chars": 100_000_000}, "max_turns": 2}
    config = fault_config(tmp_path, tiny_model, torch_server, "huge", env=env, max_steps=1)
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)[0]
    assert (metrics["failed/vf-faults"], metrics["samples/trained"]) == (0, 8), metrics
    assert took < 110, took  # under the rollout timeout: no rollout waited for it
    print(f"100 MB env answer: step in {took:.0f} s")


def test_a_reward_allocating_past_the_env_memory_limit_fails_its_rollout_and_only_that(
    tmp_path, tiny_model, torch_server, monkeypatch
):
    """`recovery.env_memory_gb`: the 8 GiB allocation fails in the worker (MemoryError), not on the host. Before, it
    was granted (untouched here; touched, the host's OOM killer would have picked a process of the run)."""
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "hog", max_steps=1,
                          recovery={"probe_timeout_s": 5, "env_memory_gb": 2})  # fmt: skip
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)[0]
    assert (metrics["failed/vf-faults"], metrics["env_servers/vf-faults/restarts"]) == (2, 0), metrics
    assert sample_errors(tmp_path) == ["task FaultTask scoring: MemoryError:"] * 2
