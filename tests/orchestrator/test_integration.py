"""End to end against the real torch inference engine with a tiny random Qwen3 (CPU)."""

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.monitor import read_metrics
from prime_core.schemas.microbatch import read_microbatches

from tests.orchestrator.conftest import publish_weights

pytestmark = pytest.mark.integration


def make_config(tmp_path, model, server, **overrides):
    base = {
        "model": {"name": str(model)},
        "output_dir": str(tmp_path),
        "seq_len": 256,
        "max_steps": 1,
        "async_level": 0,
        "batch_size": 4,
        "rollouts_per_example": 2,
        "num_trainer_ranks": 2,
        "micro_batch_rows": 2,
        "client": {"base_urls": [server.url], "max_concurrent": 8},
        "env": [{"id": "reverse-text", "args": {"num_examples": 50}}],
        "sampling": {"max_tokens": 12, "temperature": 1.0},
        "filters": {"zero_advantage_groups": False},
        "log_extras": {"interval": 1},
        "weights_timeout": 120,
    }
    for k, v in overrides.items():
        base[k] = v
    return OrchestratorConfig.model_validate(base)


def run(config, during=None):
    from prime_core.logging import setup_logging

    setup_logging("orchestrator", level="info")
    from prime_orchestrator.orchestrator import Orchestrator

    orch = Orchestrator(config)

    async def main():
        helper = asyncio.create_task(during(orch)) if during else None
        await orch.run()
        if helper:
            helper.cancel()

    asyncio.run(main())
    return orch


def test_one_step_end_to_end(tmp_path, tiny_model, torch_server, monkeypatch):
    monkeypatch.setenv("PRIME_RUN_ID", "launch-a")
    run(make_config(tmp_path, tiny_model, torch_server))
    total = 0
    for rank in range(2):
        meta, mbs = read_microbatches(tmp_path / "rollouts" / "step_0" / f"rank_{rank}.safetensors")
        assert meta.step == 0 and meta.rank == rank and meta.global_num_samples == 4
        assert meta.run_id == "launch-a"  # the trainer refuses a file of another launch
        assert meta.num_micro_batches == len(mbs) and meta.weight_steps == [0] * len(meta.weight_steps)
        for mb in mbs:
            assert mb.shape == (2, 256)
            assert (mb.inference_logprobs[mb.loss_mask] < 0).all()  # real sampled-token log-probs
            assert (mb.inference_logprobs[~mb.loss_mask] == 0).all()
            total += mb.num_loss_tokens
    assert total == meta.global_loss_tokens > 0
    record = read_metrics(tmp_path / "metrics.jsonl", "orchestrator")[0]
    m = record.values
    assert m["off_policy_lag/max"] == 0 and "reward/reverse-text/mean" in m and m["seq_len/mean"] > 0
    assert (tmp_path / "samples" / "orchestrator_step_0.jsonl").is_file()
    # The step's timeline (benchmarks/rl_gpu.py lines it up with the trainer's): weights, dispatch, results, ship.
    assert m["time/policy_served_at"] <= m["time/dispatched_at"] <= record.time
    assert 0 <= m["time/rollouts_admitted"] <= m["time/rollouts"]
    assert 0 < m["time/rollouts_first_done"] <= m["time/rollouts_half_done"] <= m["time/rollouts"]


def test_async_bound_with_slow_trainer(tmp_path, tiny_model, torch_server):
    k, steps = 1, 4
    config = make_config(
        tmp_path, tiny_model, torch_server, max_steps=steps, async_level=k, num_trainer_ranks=1, ckpt={"interval": 2}
    )
    published = {"latest": 0}
    seen_at_arrival = {}

    def fake_trainer():
        for n in range(steps):
            path = tmp_path / "rollouts" / f"step_{n}" / "rank_0.safetensors"
            while not path.exists():
                time.sleep(0.02)
            seen_at_arrival[n] = published["latest"]
            time.sleep(1.5)  # a slow optimizer step
            publish_weights(tmp_path, n + 1, tiny_model)
            published["latest"] = n + 1

    t = threading.Thread(target=fake_trainer, daemon=True)
    t.start()
    orch = run(config)
    t.join(timeout=60)
    for n in range(steps):
        assert seen_at_arrival[n] >= n - k, seen_at_arrival  # never more than async_level ahead
        meta, _ = read_microbatches(tmp_path / "rollouts" / f"step_{n}" / "rank_0.safetensors")
        assert min(meta.weight_steps) >= n - k
    lags = [r.values["off_policy_lag/max"] for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")]
    assert max(lags) <= k
    assert orch.policy.num_updates >= 2
    ckpt = json.loads((tmp_path / "checkpoints" / "step_2" / "orchestrator" / "progress.json").read_text())
    assert ckpt["step"] == 2
    assert orch.cursor_history == {}  # an entry per step once shipped would grow for the whole of a long run


def test_multi_turn_tool_env_through_token_in_route(tmp_path, tiny_model, torch_server):
    env = [{"id": "guess-number", "args": {"num_examples": 20, "max_guesses": 3}, "max_turns": 3}]
    run(make_config(tmp_path, tiny_model, torch_server, env=env, num_trainer_ranks=1, sampling={"max_tokens": 6}))
    m = read_metrics(tmp_path / "metrics.jsonl", "orchestrator")[0].values
    assert m["num_turns/mean"] > 1
    _, mbs = read_microbatches(tmp_path / "rollouts" / "step_0" / "rank_0.safetensors")
    found_env_turn = False
    for mb in mbs:
        for row in range(mb.shape[0]):
            for sid in set(mb.sample_ids[row].tolist()) - {-1}:
                mask = mb.loss_mask[row, mb.sample_ids[row] == sid].astype(int)
                # sampled (1) ... env/tool tokens (0) ... sampled (1): env turns are masked out
                changes = np.flatnonzero(np.diff(mask))
                found_env_turn |= len(changes) >= 2
    assert found_env_turn


@pytest.mark.parametrize("num_workers", [1, 2], ids=["server", "pool-worker"])
def test_killed_env_server_loses_no_rollout(tmp_path, tiny_model, torch_server, num_workers):
    """SIGKILL of the env server (one worker: the server itself; a pool: one of its workers, which verifiers' broker
    would never replace) mid-rollout: the server is restarted and every rollout of both steps is trained."""
    from prime_orchestrator.env_server import pool_workers

    env = {"id": "reverse-text", "args": {"num_examples": 50}, "num_workers": num_workers}
    config = make_config(
        tmp_path,
        tiny_model,
        torch_server,
        batch_size=8,
        max_steps=2,
        async_level=2,
        num_trainer_ranks=1,
        sampling={"max_tokens": 24},
        env=[env],
    )
    killed = []

    async def kill_server(orch):
        while "reverse-text" not in orch.pools or orch.pools["reverse-text"].server.pid is None:
            await asyncio.sleep(0.01)
        runner = orch.pools["reverse-text"]
        while not orch._requests:  # a rollout is in flight
            await asyncio.sleep(0.005)
        pid = runner.server.pid if num_workers == 1 else min(pool_workers(runner.server.pid))
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    orch = run(config, during=kill_server)
    assert killed and orch.pools["reverse-text"].server.num_restarts >= 1
    for n in range(2):
        meta, _ = read_microbatches(tmp_path / "rollouts" / f"step_{n}" / "rank_0.safetensors")
        assert meta.global_num_samples == 8
    metrics = read_metrics(tmp_path / "metrics.jsonl", "orchestrator")
    assert all(m.values["failed/rollouts"] == 0 for m in metrics)


def test_eval_prints_table(tmp_path, tiny_model, torch_server, capsys):
    from prime_orchestrator.eval_runner import run_eval

    config = EvalConfig.model_validate(
        {
            "model": {"name": str(tiny_model)},
            "output_dir": str(tmp_path),
            "environment_ids": ["reverse-text", "arithmetic"],
            "client": {"base_url": torch_server.url},
            "num_examples": 3,
            "rollouts_per_example": 2,
            "sampling": {"max_tokens": 8, "temperature": 1.0},
        }
    )
    results = asyncio.run(run_eval(config))
    out = capsys.readouterr().out
    assert "reverse-text" in out and "arithmetic" in out and "pass@2" in out
    assert set(results["base"]) == {"reverse-text", "arithmetic"}
    assert (tmp_path / "eval" / "base" / "arithmetic.json").is_file()


@pytest.mark.parametrize("k", [0, 1])
def test_dispatch_ahead_holds_rollouts_at_the_server_until_their_weights(tmp_path, tiny_model, torch_server, k):
    """``dispatch_ahead``: step n's rollouts go out while weights n - k - 1 still serve (their env side done early) and
    the server holds their requests until it serves n - k: every token of step n is still sampled with weights
    >= n - k, which the torch engine records exactly."""
    from prime_orchestrator.orchestrator import Orchestrator

    steps = 4
    config = make_config(tmp_path, tiny_model, torch_server, max_steps=steps, async_level=k, num_trainer_ranks=1,
                         dispatch_ahead=True, client={"base_urls": [torch_server.url], "max_concurrent": 16})  # fmt: skip
    base = httpx.get(f"{torch_server.url}/health").json()["weight_step"]  # the shared server: another test's step
    if base:
        httpx.post(f"{torch_server.url}/reload_weights", timeout=60).raise_for_status()

    def fake_trainer():
        for n in range(steps):
            path = tmp_path / "rollouts" / f"step_{n}" / "rank_0.safetensors"
            while not path.exists():
                time.sleep(0.02)
            time.sleep(1.0)  # the optimizer step, while the next step's rollouts wait at the server
            publish_weights(tmp_path, n + 1, tiny_model)

    orch = Orchestrator(config)
    started, sampled = [], []
    rollout = orch._rollout

    async def watched(step, *args, **kwargs):
        started.append((step, orch.policy.version))
        done = await rollout(step, *args, **kwargs)
        sampled.append((step, done.result.versions.first))
        return done

    orch._rollout = watched
    threading.Thread(target=fake_trainer, daemon=True).start()
    asyncio.run(orch.run())
    assert all(first >= n - k for n, first in sampled), sampled
    # Dispatched one update early: the rollouts of every step after the first k + 1 started on weights n - k - 1.
    assert {n: v for n, v in started if n > k} == {n: n - k - 1 for n in range(k + 1, steps)}, started
    lags = [r.values["off_policy_lag/max"] for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")]
    assert max(lags) <= k
