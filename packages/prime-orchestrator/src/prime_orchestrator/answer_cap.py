"""A bound on what one rollout's answer from an env server may carry beyond its completion.

A reward or env can put anything in a trace's ``info`` or ``metrics`` (free-form dicts), its ``rewards``, ``errors``,
``timing``, ``stop_condition``, ``tools`` and the other fields verifiers streams, or in the episode's head. Unbounded,
100 MB there crossed the wire whole and was unpacked, assembled and validated in the orchestrator (its peak grew by
about 120 MB per such rollout in flight). Each part is now measured where it is packed, in the env server, against
``recovery.max_answer_mb``:

- a trace's ``info`` or ``metrics`` past it is dropped there: replaced by ``{"prime_dropped_bytes": <size>}``; the
  orchestrator counts it (``env_servers/<env>/dropped_fields``) and logs the first one per env server in one line;
- a trace's ``errors`` past it (summed over the errors sent) are dropped likewise: the errors past the bound are not
  sent, one ``Error(type="prime_dropped_bytes")`` stands for them, removed and counted in the orchestrator (errors
  never score: a rollout keeps its reward, a failed one the last error sent);
- any other field of a trace past it (``rewards``, which score it; ``agent``, which names its seat and whether it
  trains; ``stop_condition``, which marks it truncated; ``tools``, ``timing``, ``root_reply``, the intercept
  records, judge usage, the trace's header with its task data) fails the rollout with one line naming the env, the
  field and the size: dropped, the rollout would train on a wrong reward, seat or mask;
- an episode head (its errors, run and group info) past it fails the rollout likewise.

A trace's nodes and calls (the prompt and completion tokens, calls and messages) are never cut.

A trace that holds what cannot be packed (a lock in ``info``) failed its rollout with three tracebacks in the env
server's log (a flush task's "exception was never retrieved", the request's failure, and so on per rollout). Such a
rollout now fails with one line naming the env and the cause (``UNSENDABLE``); the env server logs each cause (env and
exception type) once, and the orchestrator counts them (``env_servers/<env>/unsendable``).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
from typing import Any

logger = logging.getLogger("prime.orchestrator.env")

DROPPED = "prime_dropped_bytes"
"""The key a dropped field is replaced by, with the field's packed size in bytes."""
CAPPED_FIELDS = ("info", "metrics")
"""A trace's free-form fields that are dropped past the bound; any other field past it fails the rollout."""
DROPPED_LISTS = ("errors",)
"""A trace's append-only fields whose items past the bound (summed over the trace) are dropped."""
UNCAPPED = ("nodes", "calls")
"""A trace's completion: never cut."""
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
            if cursor is not None:
                _bound(changes, cursor, max_bytes, env)
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
            error = str(failures[0]) if isinstance(failures[0], TooBig) else unsendable(env, failures[0])
            return RunResponse(success=False, error=error)
        if size > max_bytes:
            return RunResponse(success=False, error=too_big(env, "episode head", size, max_bytes))
        return response

    capped_diff.prime_capped = True  # type: ignore[attr-defined]
    delta.DeltaStreamer.diff = capped_diff
    server.EnvServer._run = capped_run


class TooBig(ValueError):
    """A trace field past the bound that cannot be dropped: its rollout fails with this line."""


def _bound(changes: dict, cursor: Any, max_bytes: int, env: str) -> None:
    """``changes`` (one trace's delta) with its fields past ``max_bytes`` dropped, or the run failed (``TooBig``)."""
    from verifiers.v1.serve.delta import LIST_FIELDS, pack

    for field in list(changes.get("set", {})):
        if (size := len(cursor.scalars[field])) <= max_bytes:  # packed by ``diff`` already
            continue
        if field in CAPPED_FIELDS:
            changes["set"][field] = {DROPPED: size}
        else:
            _fail(changes["set"], field, too_big(env, f"trace {field}", size, max_bytes))
    if "open" in changes and (size := len(pack(changes["open"]))) > max_bytes:
        _fail(changes, "open", too_big(env, "trace header (task data)", size, max_bytes))
        changes["open"] = {"id": changes["trace"]}
    sent = vars(cursor).setdefault("prime_list_bytes", {})  # committed with the cursor once the delta is sent
    for field in [f for f in LIST_FIELDS if f in changes and f not in UNCAPPED]:
        before = sent.get(field, 0)
        sizes = [len(pack(item)) for item in changes[field]]
        sent[field] = before + sum(sizes)
        if sent[field] <= max_bytes:
            continue
        if field not in DROPPED_LISTS:
            _fail(changes, field, too_big(env, f"trace {field}", sent[field], max_bytes))
        elif before <= max_bytes:  # the delta that passes the bound: the items that fit, and one marker for the rest
            fit = next(i for i, total in enumerate(itertools.accumulate(sizes, initial=before)) if total > max_bytes)
            changes[field] = [*changes[field][: fit - 1], {"type": DROPPED, "message": str(sent[field])}]
        else:
            del changes[field]


def _fail(fields: dict, field: str, line: str) -> None:
    """The rollout fails with ``line``; ``field`` is not sent."""
    del fields[field]
    failures = _failures.get(None)
    if failures is None:
        raise TooBig(line)
    failures.append(TooBig(line))


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
    empty (the marker is no metric of the env's), a list without its marker."""
    found = []
    for trace in episode.traces:
        for field in CAPPED_FIELDS:
            value = getattr(trace, field, None)
            if isinstance(value, dict) and set(value) == {DROPPED}:
                found.append((field, int(value[DROPPED])))
                setattr(trace, field, {})
        for field in DROPPED_LISTS:
            items = getattr(trace, field, None) or []
            markers = [e for e in items if getattr(e, "type", None) == DROPPED]
            if markers:
                found += [(field, int(e.message)) for e in markers]
                setattr(trace, field, [e for e in items if getattr(e, "type", None) != DROPPED])
    return found
