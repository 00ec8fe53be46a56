"""Error answers of an inference server that a client must not retry.

Our servers answer an error as OpenAI does (``{"error": {"message", "type", "param", "code"}}``). A 5xx is usually
transient (a server busy, not ready, or waiting for weights) and clients retry it. Some are not: once vLLM's engine
core died, the server serves nothing until it is restarted, and every retry gets the same answer. The server marks
such an answer with `PERMANENT_FAULT_HEADER`, so a client (the orchestrator's weight relay) stops at the first one
instead of retrying it.
"""

from __future__ import annotations

from collections.abc import Mapping

PERMANENT_FAULT_HEADER = "X-Prime-Permanent-Fault"
"""Set on an error answer whose cause lasts until the server restarts (a dead engine); its value is `PERMANENT`."""
PERMANENT = "1"


def is_permanent(headers: Mapping[str, str]) -> bool:
    """Whether an answer's headers (case-insensitive, as httpx and Starlette give them) mark a permanent fault."""
    return headers.get(PERMANENT_FAULT_HEADER, "").strip() == PERMANENT
