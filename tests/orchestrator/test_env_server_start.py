"""Env servers start from one forkserver that imported verifiers (``prime_orchestrator.env_server.server_context``).
Each server that a spawn started imported verifiers and the tokenizer's modules again: 8 s of CPU on 2 cores (an rl
run starts one per environment, eval environments included, and again on each restart)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prime_core.config.orchestrator import EnvConfig
from prime_orchestrator.env_server import EnvServer
from prime_orchestrator.envs import server_spec

from tests.fixtures.vf import use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def parent_command(pid: int) -> str:
    ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_env_servers_fork_from_one_forkserver_that_imported_verifiers(monkeypatch):
    use_vf_envs(monkeypatch)

    async def parents() -> set[str]:
        servers = [EnvServer(server_spec(EnvConfig(id="vf-single-turn"), name=f"single-turn-{i}")) for i in range(2)]
        try:
            for server in servers:
                await server.start()
            return {parent_command(server.pid) for server in servers}
        finally:
            for server in servers:
                await server.close()

    (parent,) = asyncio.run(parents())
    assert "multiprocessing.forkserver" in parent and "verifiers.v1" in parent, parent


def test_a_forked_server_draws_numpy_numbers_of_its_own(monkeypatch):
    """A fork copies numpy's global generator: without a reseed every server of the forkserver drew the same numbers."""
    import types

    import numpy as np
    import prime_orchestrator.env_server as env_server
    import verifiers.v1.serve.pool

    spec = types.SimpleNamespace(num_workers=1, env_config={}, multiplex=1, elastic=False)
    monkeypatch.setattr(env_server.EnvServerSpec, "model_validate", lambda data: spec)
    monkeypatch.setattr(verifiers.v1.serve.pool, "serve_env", lambda **kwargs: None)
    monkeypatch.setattr(env_server, "exit_after_teardown", lambda: None)
    np.random.seed(0)
    inherited = np.random.get_state()[1].copy()
    env_server._serve({}, None, None, dict(os.environ))
    assert (np.random.get_state()[1] != inherited).any()
