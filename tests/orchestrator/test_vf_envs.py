"""The orchestrator and ``eval`` on environments written only with verifiers' public API, one per kind, against the
torch engine serving a tiny model (a scripted engine answers the tool and judge prompts). Rollouts go through
verifiers' env server and train client; what the trainer receives is checked in the micro-batch files."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.monitor import read_metrics
from prime_core.schemas.microbatch import read_microbatches

from tests.environments.test_vf_eval import script
from tests.fixtures.models import build_llama3_tokenizer, build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs
from tests.trainer.trainer_utils import read_trainer_metrics, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def orchestrate(tmp_path, model: str, url: str, env: dict, **overrides) -> dict:
    """Two steps of the orchestrator (async_level 1: both on weights 0, no trainer needed); step 0's metrics."""
    from prime_orchestrator.orchestrator import Orchestrator

    base = {
        "model": {"name": model},
        "output_dir": str(tmp_path),
        "seq_len": 1024,
        "max_steps": 2,
        "async_level": 1,
        "batch_size": 4,
        "rollouts_per_example": 2,
        "client": {"base_url": url, "max_concurrent": 8},
        "env": [env],
        "sampling": {"max_tokens": 32, "temperature": 1.0},
        "filters": {"zero_advantage_groups": False},
        "log_extras": {"interval": 1},
        "weights_timeout": 120,
    }
    asyncio.run(Orchestrator(OrchestratorConfig.model_validate({**base, **overrides})).run())
    metrics = [r.values for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")]
    assert len(metrics) == 2 and all(m["failed/rollouts"] == 0 for m in metrics), metrics
    return metrics[0]


def evaluate(tmp_path, model: str, url: str, env: dict) -> dict:
    from prime_orchestrator.eval_runner import run_eval

    config = EvalConfig.model_validate(
        {
            "model": {"name": model},
            "output_dir": str(tmp_path / "eval_out"),
            "env": [env],
            "client": {"base_url": url + "/v1"},
            "num_examples": 2,
            "rollouts_per_example": 2,
            # the scripted engine's replies are certain under greedy decoding (log-prob 0, which renderers refuse)
            "sampling": {"max_tokens": 32, "temperature": 1.0},
        }
    )
    (summary,) = asyncio.run(run_eval(config))["base"].values()
    assert summary["failed"] == 0
    return summary


def samples(tmp_path, step: int = 0):
    """(token ids, loss mask, inference log-probs) of every sample in a step's micro-batches."""
    _, mbs = read_microbatches(tmp_path / "rollouts" / f"step_{step}" / "rank_0.safetensors")
    out = []
    for mb in mbs:
        for row in range(mb.shape[0]):
            for sid in sorted(set(mb.sample_ids[row].tolist()) - {-1}):
                at = mb.sample_ids[row] == sid
                out.append((mb.input_ids[row, at], mb.loss_mask[row, at], mb.inference_logprobs[row, at]))
    return out


def decode(server, ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.config.model.name).decode(list(ids))


def test_single_turn(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-single-turn", "harness": "null"}
    m = orchestrate(tmp_path, server.config.model.name, server.url, env)
    assert m["num_turns/mean"] == 1.0 and m["samples/trained"] == 4
    for ids, mask, lps in samples(tmp_path):
        assert 0 < mask.sum() < len(ids) and (lps[mask] < 0).all() and (lps[~mask] == 0).all()
    assert evaluate(tmp_path, server.config.model.name, server.url, env)["num_turns/mean"] == 1.0


def test_multi_turn_env_every_turn_in_one_sample_env_turns_masked(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-multi-turn", "args": {"turns": 3}}
    m = orchestrate(tmp_path, server.config.model.name, server.url, env)
    assert m["num_turns/mean"] == 3.0 and m["reward/mean"] == 1.0
    for _, mask, _ in samples(tmp_path):
        # sampled, env turn (masked), sampled, env turn (masked), sampled
        assert len(np.flatnonzero(np.diff(mask.astype(int)))) >= 5
    # The trainer recomputes every sampled token's log-prob from the same tokens: the trace's ids and log-probs
    # are the engine's own (no re-tokenization), so the mismatch KL is fp32 rounding.
    run_cli(
        ["--model.name", server.config.model.name, "--output-dir", str(tmp_path), "--max-steps", "1",
         "--seq-len", "1024", "--data.wait-timeout-s", "60", "--log.level", "warning"]
    )  # fmt: skip
    trainer = read_trainer_metrics(tmp_path)[0]
    assert abs(trainer["mismatch_kl/mean"]) <= 1e-6 and trainer["loss_tokens"] == sum(
        m.sum() for _, m, _ in samples(tmp_path)
    )
    assert evaluate(tmp_path, server.config.model.name, server.url, env)["num_turns/mean"] == 3.0


def test_toolset_schema_in_prompt_tool_runs_reward_one(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-toolset", "harness": "null"}
    m = orchestrate(tmp_path, server.config.model.name, server.url, env)
    assert m["reward/mean"] == 1.0 and m["num_turns/mean"] == 2.0
    for ids, mask, _ in samples(tmp_path):
        prompt = decode(server, ids[: np.argmax(mask)])
        assert '"name": "table_lookup"' in prompt  # the tool schema reached the model's prompt
        assert "<tool_response>" in decode(server, ids[~mask]) and "<tool_response>" not in decode(server, ids[mask])
    assert evaluate(tmp_path, server.config.model.name, server.url, env)["reward/mean"] == 1.0


def test_infinite_taskset_draws_what_the_run_needs(server, tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    env = {"id": "vf-infinite", "harness": "null"}
    orchestrate(tmp_path, server.config.model.name, server.url, env)
    rows = (tmp_path / "samples" / "orchestrator_step_1.jsonl").read_text()
    assert sorted({int(x) for x in re.findall(r'"example": (\d+)', rows)}) == [2, 3]  # step 1 drew tasks 2 and 3
    assert evaluate(tmp_path, server.config.model.name, server.url, env)["num_examples"] == 2


def test_llama3_template_model_multi_turn(tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    model = save_tiny_model(tmp_path / "llama", build_llama3_tokenizer(), family="llama")
    srv = ScriptedServer(model, lambda prompt: None)
    try:
        m = orchestrate(tmp_path / "run", str(model), srv.url, {"id": "vf-multi-turn", "args": {"turns": 3}})
        assert m["num_turns/mean"] == 3.0
        for ids, _, _ in samples(tmp_path / "run"):
            text = decode(srv, ids)
            assert "<|start_header_id|>assistant<|end_header_id|>" in text and "<|im_start|>" not in text
    finally:
        srv.stop()
