"""Shared configs, schemas, run-directory layout, logging and monitors for prime (no torch)."""

__version__ = "0.1.0"
