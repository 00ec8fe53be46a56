"""Environments that fail, against the real orchestrator, env servers and the torch engine (tiny model, in-process
server): a reward function that raises, returns NaN, awaits forever or blocks its worker; an env that answers with an
enormous message; a step where too few rollouts succeed. The run goes on (the failures counted per environment, each
named in the log tables) or stops with one line, and no env-server process is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from prime_core.monitor import read_metrics
from prime_orchestrator.env_watch import process_tree

from tests.fixtures.vf import use_vf_envs
from tests.orchestrator.test_integration import make_config

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess")]


def fault_config(tmp_path, model, server, faults: str, *, every: int = 4, env: dict | None = None, **overrides):
    # A worker's first rollouts wait for its renderer and HTTP pool to load: 30 s on a busy 2-core machine.
    # The hang watch's probe keeps its default (30 s) unless a test blocks a worker (BLOCK_RECOVERY): at 5 s a fresh
    # env server of a loaded host (load 15 on 2 cores) went unanswered and was replaced where nothing hung.
    env = {"id": "vf-faults", "harness": "null", "args": {"faults": faults, "every": every}, "rollout_timeout": 120,
           **(env or {})}  # fmt: skip
    base = dict(batch_size=8, rollouts_per_example=2, max_steps=2, async_level=2, num_trainer_ranks=1,
                max_rollout_retries=1, env=[env], sampling={"max_tokens": 8})  # fmt: skip
    return make_config(tmp_path, model, server, **{**base, **overrides})


def run_orchestrator(config):
    """Run the orchestrator in this process; return it, the seconds it took, and the env-server processes that
    outlived it."""
    from prime_core.logging import setup_logging
    from prime_orchestrator.orchestrator import Orchestrator

    setup_logging("orchestrator", level="info")
    orch = Orchestrator(config)
    seen: set[int] = set()

    async def main():
        async def note_servers():  # every process of every env server (an orphan would leave the tree)
            while True:
                for pool in orch.pools.values():
                    seen.update(process_tree(pool.server.pid) if pool.server.pid else ())
                await asyncio.sleep(0.1)

        noting = asyncio.create_task(note_servers())
        try:
            await orch.run()
        finally:
            noting.cancel()

    start = time.monotonic()
    error = None
    try:
        asyncio.run(main())
    except Exception as e:  # the caller asserts on it
        error = e
    left = [pid for pid in seen if process_tree(pid)]
    return orch, time.monotonic() - start, error, left


def step_metrics(tmp_path) -> dict[int, dict]:
    return {r.step: r.values for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")}


def sample_errors(tmp_path) -> list[str]:
    rows = [json.loads(line) for p in (tmp_path / "samples").glob("*.jsonl") for line in p.read_text().splitlines()]
    return [r["completion"] for r in rows if r["failed"]]


def test_rewards_that_raise_or_are_nan_or_an_episode_that_raises_fail_their_rollouts_and_the_run_goes_on(
    tmp_path, tiny_model, torch_server, monkeypatch
):
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "raise,nan,crash", max_steps=3,
                          log_extras={"interval": 1, "num_samples": 8})  # fmt: skip
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)
    assert sorted(metrics) == [0, 1, 2]
    # 4 groups of 2 rollouts a step: step 0 has tasks 0-3 (task 0's reward raises), step 1 tasks 4-7 (task 4's is
    # NaN), step 2 tasks 8-11 (task 8's episode code raises).
    assert [metrics[s]["failed/vf-faults"] for s in (0, 1, 2)] == [2, 2, 2]
    assert metrics[2]["failed/rollouts"] == 2 and metrics[2]["env_servers/vf-faults/restarts"] == 0
    errors = sample_errors(tmp_path)
    assert any("the reward function exploded" in e for e in errors), errors
    assert any(e == "not finite: reward = nan, reward/reversed_words = nan" for e in errors), errors
    assert any("the env's episode code crashed" in e for e in errors), errors
    print(f"raise + nan + crash: 3 steps in {took:.0f} s")


@pytest.mark.slow
def test_too_few_good_rollouts_stop_the_run_with_one_line(tmp_path, tiny_model, torch_server, monkeypatch, capfd):
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "raise", every=1)
    _, _, error, left = run_orchestrator(config)
    assert left == []
    assert str(error).startswith("step 0: 8 of 8 rollouts failed (vf-faults: 8), more than "
                                 "orchestrator.recovery.min_ok_fraction = 0.5 allows; first error: ")  # fmt: skip
    assert "the reward function exploded" in str(error) and "\n" not in str(error)
    # The env server's way out stays quiet: the rollouts it still ran when the step failed could not answer a client
    # that had gone, each a warning with a traceback (~270 lines here, ~25 error lines under `rl` on a GPU).
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("failed to send") <= 2, err[-3000:]


@pytest.mark.slow
def test_a_rollout_that_hangs_is_cancelled_at_its_timeout_and_counted(tmp_path, tiny_model, torch_server, monkeypatch):
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "hang", env={"rollout_timeout": 60})
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)
    assert [metrics[s]["failed/vf-faults"] for s in (0, 1)] == [2, 2]
    # The worker stays responsive (the reward awaits): nothing is replaced, the rollout ends at its own timeout.
    assert all(e == "timed out after 60s" for e in sample_errors(tmp_path))
    assert metrics[1]["env_servers/vf-faults/restarts"] == 0
    print(f"hang: 2 steps in {took:.0f} s")


# Workers need a minute to start on a loaded 2-core host; the blocked worker is found 5 s after its reward blocks.
BLOCK = {"rollout_timeout": 600}
BLOCK_RECOVERY = {"probe_timeout_s": 5}
"""A worker silent this long is found blocked and replaced (the tests whose reward blocks a worker)."""


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_reward_that_blocks_the_only_worker_fails_what_ran_beside_it(tmp_path, tiny_model, torch_server, monkeypatch):
    """One worker: a reward that never returns blocks its event loop and every rollout on it. The server is replaced
    (5 s without a health answer) and the rollouts re-run once (max_rollout_retries = 1); the blocking task blocks it
    again, so all fail, named, and the step stops the run (recovery.min_ok_fraction)."""
    use_vf_envs(monkeypatch)
    monkeypatch.setenv("PRIME_PROGRESS_DIR", str(tmp_path / "progress"))  # as the orchestrator's entry point sets it
    config = fault_config(tmp_path, tiny_model, torch_server, "block", env=BLOCK, max_steps=1, recovery=BLOCK_RECOVERY)
    orch, took, error, left = run_orchestrator(config)
    assert left == [] and orch.pools["vf-faults"].server.num_restarts >= 2
    assert str(error).startswith("step 0: 8 of 8 rollouts failed (vf-faults: 8)")
    assert "env server vf-faults died during a rollout (the server pid " in str(error)
    assert "did not answer a health probe for" in str(error)
    # The worker's own stack names the culprit: the reward function, stuck in time.sleep (a C call, so no frame).
    assert "(its event loop is blocked in reversed_words (vf_faults/__init__.py:" in str(error)
    print(f"block (1 worker): stopped after {took:.0f} s: {error}")


@pytest.mark.slow
@pytest.mark.timeout(2400)  # each replacement restarts the pool: 1-4 min on a loaded 2-core host
def test_a_reward_that_blocks_a_pool_worker_gets_the_pool_replaced(tmp_path, tiny_model, torch_server, monkeypatch):
    """Two workers, one rollout per task, task 0 blocks: its worker is found silent, the pool replaced and the rollouts
    it held re-run (those on the other worker finish); task 0's rollout fails after its re-run, most others train."""
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "block", every=8, env={**BLOCK, "num_workers": 2},
                          max_steps=1, rollouts_per_example=1, max_rollout_retries=1,
                          recovery={**BLOCK_RECOVERY, "min_ok_fraction": 0.25})  # fmt: skip
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)[0]
    runner = orch.pools["vf-faults"]
    assert 1 <= metrics["failed/vf-faults"] < 8 and runner.server.num_restarts >= 2
    assert metrics["env_servers/vf-faults/retries"] >= 2
    print(f"block (2 workers): {metrics['failed/vf-faults']} of 8 failed, {runner.server.num_restarts} restarts, "
          f"step in {took:.0f} s")  # fmt: skip


@pytest.mark.slow
def test_an_enormous_env_answer_ends_its_rollout_at_the_context_and_nothing_else(
    tmp_path, tiny_model, torch_server, monkeypatch
):
    """The 2M-character prompt is refused (over the 512-token context; before it is tokenized, ``prompt_bound``) as the
    server refuses it; verifiers ends the episode there, ok,
    as vf-eval keeps it (the `ok` stamp decides), so it is scored on what was played, and the enormous message never
    reaches a trained sequence."""
    use_vf_envs(monkeypatch)
    env = {"id": "vf-faults", "env_args": {"huge_chars": 2_000_000}, "max_turns": 2}
    config = fault_config(tmp_path, tiny_model, torch_server, "huge", env=env, max_steps=1)
    orch, took, error, left = run_orchestrator(config)
    assert error is None and left == []
    metrics = step_metrics(tmp_path)[0]
    assert (metrics["failed/vf-faults"], metrics["samples/trained"]) == (0, 8), metrics
    assert metrics["seq_len/max"] <= 512, metrics
    print(f"huge: errors {sample_errors(tmp_path)}; step in {took:.0f} s")


def test_a_sigterm_inside_a_request_task_is_not_logged_as_a_traceback():
    """verifiers turns the stop's SIGTERM into KeyboardInterrupt wherever the process is; raised inside a request's
    task, asyncio logged "Task exception was never retrieved" with a 30-line traceback as the loop ended (seen when
    the stop came while requests were being parsed). Other errors still pass, whole."""
    import logging

    from prime_orchestrator.env_server import ClientGone

    def record(error: BaseException) -> logging.LogRecord:
        exc_info = (type(error), error, None)
        return logging.LogRecord(
            "asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (), exc_info
        )

    assert not ClientGone().filter(record(KeyboardInterrupt()))
    kept = record(ValueError("a real bug"))
    assert ClientGone().filter(kept) and kept.exc_info is not None


def test_an_env_server_stopped_runs_its_exit_handlers_then_ends_without_finalizing(tmp_path, monkeypatch):
    """After verifiers' teardown the server process ends at once (Python's teardown of verifiers, transformers and
    torch took several seconds on 2 cores, and the orchestrator waits for it at the end of every run); the exit
    handlers still run (multiprocessing's, which ends a pool's workers; logging's; temporary files'), and what the
    process printed is flushed."""
    import subprocess
    import sys

    marker = tmp_path / "atexit_ran"
    code = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('ran'))\n"
        "import prime_orchestrator.env_server as s\n"
        "print('served', end='')\n"
        "s.exit_after_teardown()\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "served"
    assert marker.read_text() == "ran"

    # The server's process entry ends so once verifiers' serve_env returned (after a SIGTERM it returns normally).
    import prime_orchestrator.env_server as env_server
    import verifiers.v1.serve.pool

    calls = []
    monkeypatch.setattr(env_server, "cap_memory", lambda limit: None)  # not this test process's memory
    monkeypatch.setattr(verifiers.v1.serve.pool, "serve_env", lambda **kwargs: calls.append("served"))
    monkeypatch.setattr(env_server, "exit_after_teardown", lambda: calls.append("exit"))
    # The environment is the orchestrator's of the moment the server started, not its forkserver's (an older one).
    monkeypatch.setenv("PRIME_TEST_ENVIRON", "forkserver's")
    env_server._serve(
        {"name": "stand-in", "env_config": {}}, None, None, {**os.environ, "PRIME_TEST_ENVIRON": "orchestrator's"}
    )
    assert calls == ["served", "exit"]
    assert os.environ["PRIME_TEST_ENVIRON"] == "orchestrator's"
