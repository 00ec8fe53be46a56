"""The two other faces: a sandbox node over HTTP (``sandbox-node``), and the verifiers runtime ``sandbox_pool``."""

from __future__ import annotations

import asyncio

import pytest
from prime_core.config.sandbox import SandboxClientConfig
from prime_orchestrator.sandbox import ExecRequest, SandboxClient, TestCase

pytestmark = pytest.mark.xdist_group("sandbox")


def test_remote_execution_with_auth(node, monkeypatch):
    monkeypatch.setenv("NODE_KEY", node.key)
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    try:
        request = ExecRequest(code="def f(x):\n    return x * 2", tests=[TestCase(expr="f(4)", expected=8)])
        result = client.execute_sync(request)
        assert result.status == "ok" and result.pass_fraction == 1.0
        bomb = client.execute_sync(ExecRequest(code="while True:\n    pass", limits={"wall_s": 0.5}))
        assert bomb.status == "timeout"
    finally:
        client.close()
    monkeypatch.setenv("NODE_KEY", "wrong")
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    try:
        denied = client.execute_sync(ExecRequest(code="print(1)"))
        assert denied.status == "sandbox_error" and "HTTP 401" in denied.reason
    finally:
        client.close()


def test_unreachable_nodes_are_a_sandbox_error():
    client = SandboxClient(SandboxClientConfig(urls=["http://127.0.0.1:9"], max_retries=1))
    try:
        result = client.execute_sync(ExecRequest(code="print(1)"))
        assert result.status == "sandbox_error" and "no sandbox node reachable" in result.reason
    finally:
        client.close()


async def _runtime_roundtrip(config: dict) -> list:
    import verifiers.v1.runtimes as vr
    from prime_orchestrator.sandbox import verifiers_runtime
    from verifiers.v1.configs.agent import AgentConfig

    agent = AgentConfig(runtime=config)
    assert isinstance(agent.runtime, verifiers_runtime.SandboxPoolRuntimeConfig)
    async with vr.provision_runtime(agent.runtime) as runtime:
        await runtime.write("pkg/hello.py", b"import sys\nprint('hi', sys.argv[1])\n")
        ran = await runtime.run(["python3", "pkg/hello.py", "there"], {"X": "1"})
        back = await runtime.read("pkg/hello.py")
        planted = await runtime.run(["sh", "-c", "ln -s /etc/shadow evil && cat evil"], {})
        return [ran, back, planted]


def test_verifiers_runtime_local_and_remote(node, monkeypatch):
    monkeypatch.setenv("NODE_KEY", node.key)
    for config in ({"type": "sandbox_pool"}, {"type": "sandbox_pool", "urls": [node.url], "api_key_var": "NODE_KEY"}):
        ran, back, planted = asyncio.run(_runtime_roundtrip(config))
        assert (ran.exit_code, ran.stdout) == (0, "hi there\n")
        assert back == b"import sys\nprint('hi', sys.argv[1])\n"
        assert planted.exit_code != 0 and "No such file" in planted.stderr


def test_verifiers_configs_accept_the_runtime():
    from prime_orchestrator.sandbox import verifiers_runtime
    from verifiers.v1.envs.isolated_verifier.env import IsolatedVerifierEnvConfig

    config = IsolatedVerifierEnvConfig.model_validate(
        {"agent": {"runtime": {"type": "subprocess"}}, "verifier": {"runtime": {"type": "sandbox_pool"}}}
    )
    assert isinstance(config.verifier.runtime, verifiers_runtime.SandboxPoolRuntimeConfig)
    assert config.agent.runtime.type == "subprocess"
    verifiers_runtime.install()  # idempotent
