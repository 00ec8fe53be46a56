"""Multi-turn number guessing game with a tool call per guess."""

__version__ = "0.1.0"
