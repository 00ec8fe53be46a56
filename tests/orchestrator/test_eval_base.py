"""``eval`` scores the base weights, not whatever the server holds: after a sweep has left a checkpoint loaded, the
next eval's ``base`` is the base model again (the server reloads it before it is scored)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prime_core.config.orchestrator import EvalConfig

from tests.orchestrator.conftest import build_model, publish_weights

pytestmark = pytest.mark.integration


def _completions(out_dir, label: str) -> list:
    rows = json.loads((out_dir / "eval" / label / "reverse-text.json").read_text())["rollouts"]
    return [row["completion"] for row in rows]


def test_base_after_a_sweep_scores_the_base_weights(tmp_path, tiny_model, torch_server):
    from prime_orchestrator.eval_runner import run_eval

    other = build_model(tmp_path / "other", seed=1)  # same tokenizer, other weights
    publish_weights(tmp_path / "run", 1, other)

    def config(out: str, steps: list[int]) -> EvalConfig:
        return EvalConfig.model_validate(
            {
                "model": {"name": str(tiny_model)},
                "output_dir": str(tmp_path / out),
                "environment_ids": ["reverse-text"],
                "client": {"base_url": torch_server.url},
                "weights_dir": str(tmp_path / "run" / "weights"),
                "steps": steps,
                "num_examples": 3,
                "rollouts_per_example": 1,
                "sampling": {"max_tokens": 8, "temperature": 0.0},
            }
        )

    try:
        asyncio.run(run_eval(config("sweep", [1])))  # base, then step_1: the server is left holding step 1
        assert httpx.get(f"{torch_server.url}/health").json()["weight_step"] == 1
        asyncio.run(run_eval(config("again", [])))
        assert httpx.get(f"{torch_server.url}/health").json()["weight_step"] == 0
    finally:
        httpx.post(f"{torch_server.url}/reload_weights", timeout=60).raise_for_status()
    base = _completions(tmp_path / "sweep", "base")
    assert _completions(tmp_path / "sweep", "step_1") != base  # greedy outputs tell the two weights apart
    assert _completions(tmp_path / "again", "base") == base
