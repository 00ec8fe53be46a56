"""A training environment whose seat runs the model's commands (verifiers' ``bash`` agent, a coding agent) on this
host's ``subprocess`` runtime is refused at start unless the run allows it: before, ``rl`` with such an environment
(every taskset without a harness of its own gets verifiers' ``bash`` under ``harness = "auto"``) gave the policy a
shell on the training host, with its files, secrets and the trainer's processes, and optimised it against that."""

from __future__ import annotations

import pytest
from prime_core.config.orchestrator import OrchestratorConfig
from prime_orchestrator.env_config import host_commands_problem

from tests.fixtures.vf import use_vf_envs
from tests.launch.test_rl_dry_run_envs import rl_dry_run

REFUSED = (
    "env.0 (vf-bash-runtime): seat 'agent' plays harness 'bash', which runs the model's commands, on this host "
    "(runtime 'subprocess' by default): the policy would be trained against the host's files, network and processes; "
    'set runtime = "sandbox_pool" (isolated, offline; or docker, podman, prime), harness = "null" for a chat seat, '
    "or allow_host_commands = true"
)


def problem(*envs: dict, **config) -> str | None:
    return host_commands_problem(OrchestratorConfig.model_validate({"env": list(envs), **config}))


def test_a_shell_seat_on_the_host_is_named_in_one_line(monkeypatch):
    use_vf_envs(monkeypatch)
    assert problem({"id": "reverse-text"}, {"id": "vf-bash-runtime"}) == REFUSED.replace("env.0", "env.1")
    explicit = problem({"id": "vf-bash-runtime", "runtime": "subprocess"})
    assert explicit is not None and "(runtime 'subprocess')" in explicit  # naming the runtime is no consent


@pytest.mark.parametrize(
    "env",
    [
        {"id": "vf-bash-runtime", "allow_host_commands": True},  # the run's consent
        {"id": "vf-bash-runtime", "harness": "null"},  # a chat seat: no commands run
        {"id": "vf-bash-runtime", "runtime": "docker", "runtime_args": {"image": "python:3.12-slim"}},  # isolated
        {"id": "vf-bash-runtime", "runtime": "sandbox_pool"},  # isolated, offline: the way out named first
        {"id": "reverse-text"},  # a taskset exporting verifiers' chat loop
        {"id": "vf-duel"},  # seats pinned to a chat loop by their Env
    ],
)
def test_chat_seats_isolated_runtimes_and_the_opt_in_pass(monkeypatch, env):
    use_vf_envs(monkeypatch)
    assert problem(env) is None


def test_the_runs_own_evals_are_refused_too(monkeypatch):
    """An eval during the run samples the policy being trained, unattended: a shell seat there runs what it learned
    to try against its training environments on the host. The opt-in and an isolated runtime pass as for training."""
    use_vf_envs(monkeypatch)
    refused = problem({"id": "reverse-text"}, eval={"envs": [{"id": "reverse-text"}, {"id": "vf-bash-runtime"}]})
    assert refused == REFUSED.replace("env.0", "eval.envs.1").replace(
        "would be trained against", "being trained would act on"
    )
    allowed = {"id": "vf-bash-runtime", "allow_host_commands": True}
    assert problem({"id": "reverse-text"}, eval={"envs": [allowed]}) is None


@pytest.mark.integration
def test_rl_dry_run_refuses_it_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    use_vf_envs(monkeypatch)
    refused = rl_dry_run(tmp_path / "run", "--orchestrator.env", '[{"id": "vf-bash-runtime"}]')
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == f"error: orchestrator: {REFUSED}\n"
