"""Asynchronous rollout orchestrator for prime over verifiers environments (no torch)."""

__version__ = "0.1.0"
