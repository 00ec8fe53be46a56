"""Env servers start from one forkserver that imported verifiers (``prime_orchestrator.env_server.server_context``).
Each server that a spawn started imported verifiers and the tokenizer's modules again: 8 s of CPU on 2 cores (an rl
run starts one per environment, eval environments included, and again on each restart)."""

from __future__ import annotations

import asyncio
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
