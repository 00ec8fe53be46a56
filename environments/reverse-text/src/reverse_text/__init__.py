"""Reverse a short chunk of text (LCS-ratio reward)."""

__version__ = "0.1.0"
