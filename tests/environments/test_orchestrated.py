"""This repository's environments through OUR orchestrator and ``eval`` (verifiers' env server and train client
underneath), against the torch engine under the scripted engine of ``test_vf_eval``: guess-number plays a real
multi-turn game (the env's turns masked in the trainer's samples), tool-use calls its calculator (reward 1.0)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.monitor import read_metrics
from prime_core.schemas.microbatch import read_microbatches

from tests.environments.test_vf_eval import script
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, script)
    yield srv
    srv.stop()


def orchestrate(tmp_path, server, env: dict, max_concurrent: int = 8) -> list[dict]:
    """Two orchestrator steps (async_level 1: both on weights 0, no trainer needed); each step's metrics."""
    from prime_orchestrator.orchestrator import Orchestrator

    config = {
        "model": {"name": server.config.model.name},
        "output_dir": str(tmp_path),
        "seq_len": 1024,
        "max_steps": 2,
        "async_level": 1,
        "batch_size": 4,
        "rollouts_per_example": 2,
        "client": {"base_url": server.url, "max_concurrent": max_concurrent},
        "env": [env],
        "sampling": {"max_tokens": 32, "temperature": 1.0},
        "filters": {"zero_advantage_groups": False},
        "weights_timeout": 120,
    }
    asyncio.run(Orchestrator(OrchestratorConfig.model_validate(config)).run())
    metrics = [r.values for r in read_metrics(tmp_path / "metrics.jsonl", "orchestrator")]
    assert len(metrics) == 2 and all(m["failed/rollouts"] == 0 for m in metrics), metrics
    return metrics


def evaluate(tmp_path, server, env: dict, max_concurrent: int = 8) -> dict:
    from prime_orchestrator.eval_runner import run_eval

    config = EvalConfig.model_validate(
        {
            "model": {"name": server.config.model.name},
            "output_dir": str(tmp_path / "eval"),
            "env": [env],
            "client": {"base_url": server.url, "max_concurrent": max_concurrent},
            "num_examples": 2,
            "rollouts_per_example": 2,
            "sampling": {"max_tokens": 32},
        }
    )
    (summary,) = asyncio.run(run_eval(config))["base"].values()
    assert summary["failed"] == 0
    return summary


def sample_masks(tmp_path, step: int):
    _, mbs = read_microbatches(tmp_path / "rollouts" / f"step_{step}" / "rank_0.safetensors")
    for mb in mbs:
        for row in range(mb.shape[0]):
            for sid in sorted(set(mb.sample_ids[row].tolist()) - {-1}):
                at = mb.sample_ids[row] == sid
                yield mb.input_ids[row, at], mb.loss_mask[row, at], mb.inference_logprobs[row, at]


def test_guess_number_trains_every_turn_of_the_game(server, tmp_path):
    env = {"id": "guess-number", "args": {"num_examples": 20, "high": 16, "max_guesses": 6}}
    for m in orchestrate(tmp_path, server, env):
        # binary search over 1..16 takes 1 to 5 guesses; each is a model turn
        assert m["num_turns/mean"] > 1 and m["reward/guess-number/mean"] >= 0.5
    for step in (0, 1):
        for _, mask, logprobs in sample_masks(tmp_path, step):
            runs = len(np.flatnonzero(np.diff(mask.astype(int))))
            assert runs >= 1 and (logprobs[mask] < 0).all() and (logprobs[~mask] == 0).all()
    summary = evaluate(tmp_path, server, env)
    assert summary["reward/mean"] >= 0.5 and summary["num_turns/mean"] > 1


def test_tool_use_calls_the_calculator_in_training_and_eval(server, tmp_path, monkeypatch):
    env = {"id": "tool-use", "args": {"num_examples": 20}}
    # As on a GPU node without internet: no uv on PATH and no package index. verifiers' own null harness would
    # bootstrap uv and sync its chat program's dependencies there; prime-chat runs the program's loop in-process.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    # One calculator server per env worker serves every rollout (a taskset-scoped toolset).
    for m in orchestrate(tmp_path, server, env, max_concurrent=8):
        assert m["reward/tool-use/mean"] == 1.0 and m["num_turns/mean"] == 2.0
    for _, mask, _ in sample_masks(tmp_path, 0):
        # sampled call, masked tool result, sampled answer
        assert len(np.flatnonzero(np.diff(mask.astype(int)))) >= 3
    assert evaluate(tmp_path, server, env, max_concurrent=8)["reward/mean"] == 1.0


def test_color_shapes_rollouts_carry_their_images_to_the_trainer(tmp_path):
    """A vision-language model's rollouts through verifiers (renderers' ``qwen3-vl`` token-in with one placeholder
    per image, expanded by our server): every sample reaches the micro-batch with its image's patches."""
    from prime_core.vision import VisionSpec

    from tests.fixtures.models import save_tiny_qwen3_vl_model

    model = save_tiny_qwen3_vl_model(tmp_path / "vl")
    # A fixed reply: the random model would sample image placeholder tokens, and packing drops those samples.
    srv = ScriptedServer(model, lambda prompt: "a red circle")
    try:
        orchestrate(tmp_path / "run", srv, {"id": "color-shapes", "args": {"num_examples": 8}})
    finally:
        srv.stop()
    vision = VisionSpec.from_model_dir(model)
    _, mbs = read_microbatches(tmp_path / "run" / "rollouts" / "step_0" / "rank_0.safetensors")
    num_samples = sum(len(set(mb.sample_ids[row].tolist()) - {-1}) for mb in mbs for row in range(mb.shape[0]))
    grids = np.concatenate([mb.image_grid_thw for mb in mbs])
    assert num_samples == 4 and len(grids) == 4  # one image per rollout
    placeholders = sum(int((mb.input_ids == vision.image_token_id).sum()) for mb in mbs)
    assert placeholders == sum(vision.processor.num_tokens(tuple(g)) for g in grids)
    assert sum(len(mb.pixel_values) for mb in mbs) == int(np.prod(grids, axis=1).sum())
