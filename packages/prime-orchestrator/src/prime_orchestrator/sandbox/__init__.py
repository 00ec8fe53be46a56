"""Isolated execution of untrusted code at millisecond latency (see docs/sandboxes.md).

- :func:`run` / :func:`arun`: the direct API, ``run(code, stdin=..., tests=[TestCase(...)], limits=...)``.
- :class:`SandboxPool`: the local pool (Linux namespaces + warm zygotes), for one event loop.
- :class:`SandboxClient`: a pool or sandbox nodes (``PRIME_SANDBOX_URLS``), from any loop or thread.
- ``sandbox-node``: the pool behind HTTP (:mod:`.server`); ``import prime_orchestrator.sandbox.verifiers_runtime``
  adds ``runtime = {type = "sandbox_pool"}`` to verifiers.

Nothing here starts a process or imports verifiers until used.
"""

from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits, SandboxNodeConfig, SandboxPoolConfig

from prime_orchestrator.sandbox.schemas import ExecRequest, ExecResult, TestCase, TestOutcome

__all__ = [
    "ExecRequest",
    "ExecResult",
    "SandboxClient",
    "SandboxClientConfig",
    "SandboxLimits",
    "SandboxNodeConfig",
    "SandboxPool",
    "SandboxPoolConfig",
    "SandboxUnavailable",
    "TestCase",
    "TestOutcome",
    "arun",
    "get_client",
    "run",
]


def __getattr__(name: str):
    if name in ("SandboxPool", "SandboxUnavailable"):
        from prime_orchestrator.sandbox import pool

        return getattr(pool, name)
    if name in ("SandboxClient", "get_client", "run", "arun"):
        from prime_orchestrator.sandbox import client

        return getattr(client, name)
    raise AttributeError(f"module 'prime_orchestrator.sandbox' has no attribute {name!r}")
