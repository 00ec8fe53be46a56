"""Helpers of the launcher tests (imported by name: tests/launch is on sys.path under pytest's prepend mode)."""

import socket
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
