"""A bound on what one rollout's answer from an env server may carry beyond its completion.

A reward or env can put anything in a trace's ``info`` or ``metrics`` (free-form dicts), or in the task data the
episode's head carries back. Unbounded, 100 MB there crossed the wire whole and was unpacked, assembled and validated
in the orchestrator (its peak grew by about 120 MB per such rollout in flight). Each part is now measured where it is
packed, in the env server, against ``recovery.max_answer_mb``:

- a trace's ``info`` or ``metrics`` past it is dropped there: replaced by ``{"prime_dropped_bytes": <size>}``; the
  orchestrator counts it (``env_servers/<env>/dropped_fields``) and logs the first one per env server in one line;
- an episode head (task data, errors) past it fails the rollout with one line naming the env and the size.

Everything else of a trace (its nodes, i.e. the prompt and completion tokens, calls and messages) is never cut.

A trace that holds what cannot be packed (a lock in ``info``) failed its rollout with three tracebacks in the env
server's log (a flush task's "exception was never retrieved", the request's failure, and so on per rollout). Such a
rollout now fails with one line naming the env and the cause (``UNSENDABLE``); the env server logs each cause (env and
exception type) once, and the orchestrator counts them (``env_servers/<env>/unsendable``).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

logger = logging.getLogger("prime.orchestrator.env")

DROPPED = "prime_dropped_bytes"
"""The key a dropped field is replaced by, with the field's packed size in bytes."""
CAPPED_FIELDS = ("info", "metrics")
"""A trace's free-form fields that are dropped past the bound (the rest of a trace is typed or the completion)."""
UNSENDABLE = "cannot be sent"
"""In the error of a rollout whose answer could not be packed."""
_failures: contextvars.ContextVar[list[BaseException]] = contextvars.ContextVar("prime_answer_failures")
"""A run's pack failures, seen by its delta flushes (tasks created in the run's context)."""


def install(max_bytes: int, env: str) -> None:
    """In an env server process: bound each trace delta's ``CAPPED_FIELDS`` and each run's head to ``max_bytes``."""
    from verifiers.v1.serve import delta, server
    from verifiers.v1.serve.types import RunResponse

    if getattr(delta.DeltaStreamer.diff, "prime_capped", False):
        return
    diff, run = delta.DeltaStreamer.diff, server.EnvServer._run

    @functools.wraps(diff)
    def capped_diff(self: Any) -> list:
        try:
            found = diff(self)
        except (TypeError, ValueError) as e:  # pydantic's serialisation error is a ValueError
            failures = _failures.get(None)
            if failures is None:
                raise
            failures.append(e)
            return []  # nothing sent; the run ends failed (``capped_run``)
        for _, changes, cursor in found:
            for field in CAPPED_FIELDS:
                changed = cursor is not None and field in changes.get("set", {})
                if changed and (size := len(cursor.scalars[field])) > max_bytes:  # packed by ``diff`` already
                    changes["set"][field] = {DROPPED: size}
        return found

    @functools.wraps(run)
    async def capped_run(self: Any, req: Any, client_id: bytes, request_id: bytes) -> Any:
        failures: list[BaseException] = []
        _failures.set(failures)
        response = await run(self, req, client_id, request_id)
        try:
            size = len(delta.pack(response.head)) if response.head is not None else 0
        except (TypeError, ValueError) as e:
            failures.append(e)
        if failures:
            return RunResponse(success=False, error=unsendable(env, failures[0]))
        if size > max_bytes:
            return RunResponse(success=False, error=too_big(env, "episode head", size, max_bytes))
        return response

    capped_diff.prime_capped = True  # type: ignore[attr-defined]
    delta.DeltaStreamer.diff = capped_diff
    server.EnvServer._run = capped_run


_told: set[str] = set()


def unsendable(env: str, error: BaseException) -> str:
    """The one line of a rollout whose answer could not be packed; logged once per cause in this process."""
    from prime_core.io import one_line

    line = one_line(f"env {env}: the rollout's answer {UNSENDABLE}: {type(error).__name__}: {error}")
    if type(error).__name__ not in _told:
        _told.add(type(error).__name__)
        logger.warning("%s (later rollouts failing so are not logged here; counted in env_servers/%s/unsendable)",
                       line, env)  # fmt: skip
    return line


def too_big(env: str, part: str, size: int, max_bytes: int) -> str:
    return (
        f"env {env}: the rollout's {part} is {size / 1e6:.1f} MB, over recovery.max_answer_mb = {max_bytes / 1e6:g} MB"
    )


def take_dropped(episode: Any) -> list[tuple[str, int]]:
    """``(field, bytes)`` for each field the env server dropped from ``episode``'s traces; each such field is left
    empty (the marker is no metric of the env's)."""
    found = []
    for trace in episode.traces:
        for field in CAPPED_FIELDS:
            value = getattr(trace, field, None)
            if isinstance(value, dict) and set(value) == {DROPPED}:
                found.append((field, int(value[DROPPED])))
                setattr(trace, field, {})
    return found
