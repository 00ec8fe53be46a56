"""End to end: rollouts whose reply sabotages the paths a ``sandbox_pool`` reward reads and writes are scored 0 and
counted by our eval, none failed; the honest reply scores 1 (tests/fixtures/vf_envs/vf_sandbox_answer)."""

from __future__ import annotations

import os
import re

import pytest

from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import VF_ENVS, use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), pytest.mark.xdist_group("sandbox")]


def _attacks() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vf_sandbox_answer", VF_ENVS / "vf_sandbox_answer" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ATTACKS


def _eval(tmp_path, server, env: dict) -> tuple[dict, list[dict]]:
    import asyncio
    import json

    from prime_core.config.orchestrator import EvalConfig
    from prime_orchestrator.eval_runner import run_eval

    config = EvalConfig.model_validate(
        {
            "model": {"name": server.config.model.name},
            "output_dir": str(tmp_path / "eval"),
            "env": [env],
            "client": {"base_url": server.url},
            "num_examples": env["args"]["num_tasks"],
            "rollouts_per_example": 1,
            "sampling": {"max_tokens": 48, "temperature": 1.0},
        }
    )
    (summary,) = asyncio.run(run_eval(config))["base"].values()
    rows = json.loads((tmp_path / "eval" / "eval" / "base" / f"{env['id']}.json").read_text())["rollouts"]
    return summary, rows


def test_sabotaged_answers_are_scored_zero_not_failed(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root")
    use_vf_envs(monkeypatch)
    attacks = _attacks()

    def script(prompt: str) -> str | None:
        m = re.search(r"Sandbox attack (\d+):", prompt)
        return attacks[int(m.group(1))] if m else None

    server = ScriptedServer(save_tiny_model(tmp_path / "model", build_tool_tokenizer()), script)
    try:
        runtime = {"type": "sandbox_pool", "limits": {"wall_s": 5, "cpu_s": 5}}
        env = {"id": "vf-sandbox-answer", "harness": "null", "args": {"num_tasks": len(attacks), "runtime": runtime}}
        summary, rows = _eval(tmp_path, server, env)
    finally:
        server.stop()
    assert summary["failed"] == 0, [r["error"] for r in rows]
    rewards = {row["completion"].removeprefix("[assistant]").strip(): row["reward"] for row in rows}
    assert rewards == {**{a: 0.0 for a in attacks}, attacks[0]: 1.0}
