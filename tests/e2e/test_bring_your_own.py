"""Environments a user brings, trained by the real ``rl`` on a CPU for two steps with the base model for them
(examples/bring_your_own/model): the two-player zero-sum game in self-play, where the mean of the two payoffs is 0
in every episode and only per-seat credit leaves anything to train; then (slow) each other kind of test environment
against a scripted policy served outside ``rl``, so its rewards are known."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prime_core.schemas import read_microbatches

from tests.e2e.test_reverse_text import metrics
from tests.fixtures.vf import vf_envs_path
from tests.tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
RL = Path(sys.executable).with_name("rl")
MODEL = ROOT / "examples" / "bring_your_own" / "model"

# `rl` runs: not in the `multiprocess` xdist group (see tests/e2e/test_reverse_text.py).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def rl_config(tmp_path: Path, env: str, *, model: Path = MODEL, server: str | None = None) -> Path:
    """A two-step rl.toml: 4 tasks x 4 rollouts a step; rl starts the torch engine unless ``server`` is given."""
    lines = [
        "max_steps = 2",
        "seq_len = 1024",
        "async_level = 1",
        f'[model]\nname = "{model}"',
        '[trainer]\ndevice = "cpu"',
        "[orchestrator]\nbatch_size = 16\nrollouts_per_example = 4",
        "[orchestrator.sampling]\ntemperature = 1.0\nmax_tokens = 12",
        f"[[orchestrator.env]]\n{env}",
    ]
    if server is None:
        lines.append('[inference]\nengine = "torch"')
    else:
        lines.append(f'[orchestrator.client]\nbase_urls = ["{server}"]')
    path = tmp_path / "rl.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_rl(config: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (vf_envs_path(), os.environ.get("PYTHONPATH")) if p)}
    args = [str(RL), "@", str(config), "--output-dir", str(out), "--console", "quiet"]
    if "[inference]" in config.read_text():
        args += ["--inference.server.port", str(free_port())]
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (out / "weights" / "step_2" / "STABLE").exists()


def trained_advantages(out: Path, step: int) -> np.ndarray:
    _, mbs = read_microbatches(out / "rollouts" / f"step_{step}" / "rank_0.safetensors")
    return np.concatenate([mb.advantages[mb.loss_mask] for mb in mbs])


def test_two_player_self_play_trains_both_seats_on_their_own_rewards(tmp_path):
    out = tmp_path / "run"
    run_rl(rl_config(tmp_path, 'id = "vf-duel"'), out)
    first, second = metrics(out, "orchestrator", "reward/vf-duel/first/mean"), metrics(out, "orchestrator",
                                                                                        "reward/vf-duel/second/mean")  # fmt: skip
    assert sorted(first) == sorted(second) == [0, 1]
    for step in (0, 1):
        assert first[step] + second[step] == pytest.approx(0.0)  # zero-sum: the mean payoff is 0, always
        assert metrics(out, "orchestrator", "advantage/nonzero_fraction")[step] > 0
        assert metrics(out, "orchestrator", "samples/trained")[step] > 0
        advantages = trained_advantages(out, step)
        assert np.abs(advantages).max() > 0 and advantages.sum() == pytest.approx(0.0, abs=1e-3)
    trainer = metrics(out, "trainer", "grad_norm")
    assert sorted(trainer) == [0, 1] and all(g > 0 for g in trainer.values())


SCRIPTED_KINDS = {
    "vf-attempts": 'id = "vf-attempts"',
    # Their seats play verifiers' bash agent, which runs the policy's commands: in the sandbox, offline (rl refuses the
    # host's subprocess runtime unless told).
    "vf-bash-runtime": 'id = "vf-bash-runtime"\nruntime = "sandbox_pool"',
    # Its judge is the policy server: the scripted policy answers the judge's prompts too (rl refuses that unless told).
    "vf-rubric": 'id = "vf-rubric"\nruntime = "sandbox_pool"\n[orchestrator.judge]\nallow_policy_judge = true',
    "vf-toolset": 'id = "vf-toolset"\nharness = "null"',
}


@pytest.mark.slow
@pytest.mark.parametrize("env_id", list(SCRIPTED_KINDS))
def test_each_kind_trains_two_rl_steps_against_a_scripted_policy(tmp_path, monkeypatch, env_id):
    from tests.environments.test_vf_kinds import script
    from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
    from tests.fixtures.scripted import ScriptedServer
    from tests.fixtures.vf import use_vf_envs

    use_vf_envs(monkeypatch)
    model = save_tiny_model(tmp_path / "model", build_tool_tokenizer())
    server = ScriptedServer(model, script)
    try:
        out = tmp_path / "run"
        # constant rewards (the script always answers right) would filter every group: train them anyway
        config = rl_config(tmp_path, SCRIPTED_KINDS[env_id], model=model, server=server.url)
        config.write_text(config.read_text().replace("[orchestrator.sampling]", "[orchestrator.filters]\n"
                                                     "zero_advantage_groups = false\n[orchestrator.sampling]"))  # fmt: skip
        run_rl(config, out)
    finally:
        server.stop()
    rewards = metrics(out, "orchestrator", "reward/mean")
    expected = 0.75 if env_id == "vf-attempts" else 1.0  # attempts: (1.5 + 0) / 2
    assert rewards == {0: expected, 1: expected}
    assert metrics(out, "orchestrator", "failed/rollouts") == {0: 0, 1: 0}
    assert sorted(metrics(out, "trainer", "loss/mean")) == [0, 1]
