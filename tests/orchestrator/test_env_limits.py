"""``env_limits``: each process of an env server may allocate at most ``recovery.env_memory_gb`` (default half of
the host's memory); past it the allocation fails in that process (``MemoryError``), and its children inherit it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA counts anonymous memory on Linux")

PROGRAM = """
import subprocess, sys
from prime_orchestrator.env_limits import cap_memory
cap_memory(256 << 20)
kept = bytes(64 << 20)  # under the limit
try:
    bytes(1 << 30)
    print("granted")
except MemoryError:
    print("refused")
child = "import sys\\ntry:\\n    bytes(1 << 30)\\nexcept MemoryError:\\n    sys.exit(3)"
print(subprocess.run([sys.executable, "-c", child]).returncode)
"""


def test_an_allocation_past_the_limit_fails_in_the_process_and_in_its_children():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["refused", "3"], out.stderr


def test_the_limit_is_the_configured_gib_else_half_the_host_and_never_raised(monkeypatch):
    import resource

    from prime_orchestrator.env_limits import GIB, host_memory, memory_limit

    assert memory_limit(2) == 2 * GIB and memory_limit(0.5) == GIB // 2 and memory_limit(None) == host_memory() // 2
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (GIB, 4 * GIB))
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: calls.append(limits))
    from prime_orchestrator.env_limits import cap_memory

    cap_memory(2 * GIB)  # an administrator's lower soft limit stays
    cap_memory(GIB // 2)
    assert calls == [(GIB, 4 * GIB), (GIB // 2, 4 * GIB)]


def test_the_run_sets_each_env_servers_limit_from_recovery(monkeypatch):
    from prime_core.config.liveness import RecoveryConfig
    from prime_core.config.orchestrator import EnvConfig
    from prime_orchestrator import envs
    from prime_orchestrator.env_limits import GIB, host_memory

    monkeypatch.setattr(envs, "env_config_data", lambda env, judge: {})  # not resolved through verifiers here
    env = EnvConfig(id="any")
    assert envs.server_spec(env, recovery=RecoveryConfig(env_memory_gb=3)).max_memory_bytes == 3 * GIB
    assert envs.server_spec(env).max_memory_bytes == host_memory() // 2
