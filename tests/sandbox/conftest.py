"""A sandbox pool shared by the sandbox tests, and the host-side checks they use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox import ExecRequest, ExecResult, SandboxClient
from prime_orchestrator.sandbox.pool import NUM_LEASES, SandboxUnavailable

UID_BASE = 310_000  # away from the default range, so a pool of another process is never counted here
MAX_CONCURRENCY = 64
# Generous: every test that loops forever sets its own wall limit; the rest end on their own, even on a loaded host.
FAST = SandboxLimits(wall_s=20, cpu_s=20)


def sandbox_pids() -> list[int]:
    """Live host processes running as any execution or workspace uid of the test pool (a leak when no execution
    runs). Zombies are dead already: an orphan waits there for the host's init to reap it."""
    hi = UID_BASE + MAX_CONCURRENCY + NUM_LEASES
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "-1").split()[0])
        if UID_BASE <= uid < hi and not fields.get("State", "").strip().startswith(("Z", "X")):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="session")
def sandbox():
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root (user namespaces with a uid range)")
    config = SandboxClientConfig(pool=SandboxPoolConfig(uid_base=UID_BASE, max_concurrency=MAX_CONCURRENCY, zygotes=1))
    try:
        client = SandboxClient(config)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
    yield client
    client.close()
    assert sandbox_pids() == []


def run(sandbox: SandboxClient, code: str = "", **kw) -> ExecResult:
    kw.setdefault("limits", FAST)
    return sandbox.execute_sync(ExecRequest(code=code, **kw))


def assert_serving(sandbox: SandboxClient) -> None:
    """The pool still runs code, and nothing of earlier executions is alive."""
    result = run(sandbox, "print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n"), result
    assert sandbox_pids() == []
