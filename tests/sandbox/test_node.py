"""A sandbox node's defaults (issue #37, class "node"): loopback unless told otherwise, never reachable from other
machines without a key, every route behind it, bodies capped, workspace names unguessable; and what a node holds
(its key) never reaches the code it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from prime_core.config.sandbox import SandboxClientConfig, SandboxNodeConfig
from prime_orchestrator.sandbox import ExecRequest, SandboxClient
from pydantic import ValidationError

from tests.sandbox import attacks

pytestmark = pytest.mark.xdist_group("sandbox")


def test_defaults_are_loopback_and_a_public_address_needs_a_key():
    assert SandboxNodeConfig().host == "127.0.0.1"
    for host in ("0.0.0.0", "::", "10.0.0.5", "node.example"):
        with pytest.raises(ValidationError, match="api_key_var"):
            SandboxNodeConfig(host=host)
    assert SandboxNodeConfig(host="0.0.0.0", api_key_var="K").host == "0.0.0.0"
    assert SandboxNodeConfig(host="::1").host == "::1"
    argv = [sys.executable, "-m", "prime_orchestrator.entrypoints.sandbox_node", "--host", "0.0.0.0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "api_key_var" in out.stderr and "Traceback" not in out.stderr


def test_every_route_wants_the_key(node):
    routes = [("POST", "/execute", b'{"code": "print(1)"}'), ("GET", "/health", None)]
    routes += [("POST", "/workspaces", b"{}"), ("DELETE", "/workspaces/ws-anything", None)]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, node.url + path, content=body, headers=headers, timeout=30)
            assert resp.status_code == 401, (method, path, resp.status_code)
    health = httpx.get(node.url + "/health", headers={"Authorization": f"Bearer {node.key}"}, timeout=30)
    assert health.status_code == 200 and health.json()["zygotes"] >= 1 and "executions_completed" in health.json()


def test_workspace_names_are_unguessable_and_unknown_ones_404(node):
    auth = {"Authorization": f"Bearer {node.key}"}
    names = [httpx.post(node.url + "/workspaces", json={}, headers=auth, timeout=30).json()["name"] for _ in range(3)]
    try:
        assert len(set(names)) == 3 and all(len(n) >= 24 for n in names), names
        assert len({n[:8] for n in names}) == 3  # not a counter: they differ right after the prefix
    finally:
        for name in names:
            assert httpx.delete(f"{node.url}/workspaces/{name}", headers=auth, timeout=30).status_code == 200
    assert httpx.delete(f"{node.url}/workspaces/{names[0]}", headers=auth, timeout=30).status_code == 404


def test_bodies_are_capped_and_oversized_requests_fail_alone(node, monkeypatch):
    monkeypatch.setenv("NODE_KEY", node.key)
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    try:
        huge = client.execute_sync(ExecRequest(code="#" * (40 << 20)))
        assert huge.status == "error" and "HTTP 413" in huge.reason, huge.reason
        big = client.execute_sync(ExecRequest(code="x = 1\n" + "#" * (9 << 20)))
        assert big.status == "error" and "max_code_bytes" in big.reason, big.reason
        assert client.execute_sync(ExecRequest(code="print(3)")).stdout == "3\n"
    finally:
        client.close()


def test_the_nodes_key_never_reaches_the_code(node, monkeypatch):
    monkeypatch.setenv("NODE_KEY", node.key)
    client = SandboxClient(SandboxClientConfig(urls=[node.url], api_key_var="NODE_KEY"))
    try:
        scan = client.execute_sync(ExecRequest(code=attacks.STACK_SCAN))
        env = client.execute_sync(ExecRequest(argv=["sh", "-c", "env"]))
    finally:
        client.close()
    assert scan.status == "ok" and int(scan.stdout.split()[1]) >= 4096, scan
    assert node.key not in scan.stdout + env.stdout and "NODE_KEY" not in scan.stdout + env.stdout
    assert os.environ["NODE_KEY"] == node.key  # the test did hold it, in the client's and the node's environment
