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
    import numpy as np
    import prime_orchestrator.env_server as env_server
    import verifiers.v1.serve.pool

    monkeypatch.setattr(env_server, "cap_memory", lambda limit: None)  # not this test process's memory
    monkeypatch.setattr(verifiers.v1.serve.pool, "serve_env", lambda **kwargs: None)
    monkeypatch.setattr(env_server, "exit_after_teardown", lambda: None)
    np.random.seed(0)
    inherited = np.random.get_state()[1].copy()
    env_server._serve({"name": "stand-in", "env_config": {}}, None, None, dict(os.environ))
    assert (np.random.get_state()[1] != inherited).any()


class _EnvClient:
    """verifiers' ``EnvClient`` to a server that never answers (it died starting)."""

    def __init__(self, address):
        self.address = address

    async def health(self, timeout):
        return False

    async def close(self):
        pass


@pytest.mark.parametrize("when", ["before its address", "after its address"])
def test_a_server_that_exits_while_starting_is_one_line_naming_the_cause(monkeypatch, when):
    """The fast form of tests/environments/test_vf_tasksets.py::test_an_env_whose_start_raises_is_one_line_naming_the_
    cause (20 s: verifiers imported in a fresh interpreter, the nemo_gym Env): a real server process (forked from
    this one, so that verifiers' ``serve_env`` is a stand-in that raises) exits while starting, before it put its
    address or after (verifiers puts it before the Env starts). Before EnvServerFailed, that was a traceback and "env
    server nemo_gym exited with code 1 while starting; see its log above", or "env server nemo_gym did not become
    healthy (exit code 1)"; now one line names the cause."""
    import multiprocessing as mp
    import sys
    import types

    import prime_orchestrator.env_server as env_server
    from prime_orchestrator.env_server import EnvServerFailed

    def serve_env(address_queue, **kwargs):
        if when == "after its address":
            address_queue.put("tcp://127.0.0.1:1")
        raise ValueError("set --env.taskset.task.resources-url\n(a NeMo Gym resource server)")

    # Stand-ins by module name: neither this process nor the server imports verifiers (5 s of CPU).
    monkeypatch.setitem(sys.modules, "verifiers.v1.serve.pool", types.SimpleNamespace(serve_env=serve_env))
    monkeypatch.setitem(sys.modules, "verifiers.v1.serve.client", types.SimpleNamespace(EnvClient=_EnvClient))
    monkeypatch.setattr(env_server, "server_context", lambda: mp.get_context("fork"))
    spec = env_server.EnvServerSpec(name="nemo_gym", env_config={}, start_timeout=60)
    with pytest.raises(EnvServerFailed) as failed:
        asyncio.run(EnvServer(spec).start())
    exited = "exited while starting" if when == "before its address" else "exited with code 1 while starting"
    assert str(failed.value) == (
        f"env server nemo_gym {exited}: ValueError: set --env.taskset.task.resources-url ... (a NeMo Gym resource "
        "server)"
    )
