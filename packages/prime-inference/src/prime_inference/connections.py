"""uvicorn as both apps run it, with a bound on how long a client may take to send a request.

uvicorn's ``timeout_keep_alive`` only runs between a response and the next request, and any byte restarts it: a
connection that never sends a request, or sends its headers a byte at a time (slowloris), stayed open for good, and
a few thousand of them exhaust the server's file descriptors. Here every connection must deliver each whole request
(headers and body) within ``server.timeout_keep_alive`` seconds of opening or of its previous response; else it is
closed (a request whose body was cut is answered with nothing: its client is gone). uvicorn's warnings that any
client can trigger pass at most once a minute (``ClientWarningsPerMinute``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import h11
from prime_core.config.inference import InferenceConfig
from uvicorn.protocols.http.h11_impl import H11Protocol


class _RequestDeadline:
    """Closes a connection whose request is not fully received by its deadline (mixed into uvicorn's protocols)."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.config.timeout_keep_alive, self._expire)  # type: ignore[attr-defined]

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


class H11RequestDeadline(_RequestDeadline, H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request is in: its handler may take as long as generation takes

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # not when a pipelined request was already read
            self._arm()


def _httptools_protocol() -> type | None:
    """The httptools protocol with the deadline (uvicorn's faster parser, which ``auto`` picks when installed)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HttpToolsRequestDeadline(_RequestDeadline, HttpToolsProtocol):
        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def on_response_complete(self) -> None:
            idle = not self.pipeline
            super().on_response_complete()
            if idle and not self.transport.is_closing():
                self._arm()

    return HttpToolsRequestDeadline


def uvicorn_config(app: Any, config: InferenceConfig, **overrides: Any) -> Any:
    """The uvicorn config of a server: address, keep-alive and shutdown bounds from ``config.server``."""
    import uvicorn

    kwargs = dict(
        host=config.server.host,
        port=config.server.port,
        timeout_keep_alive=config.server.timeout_keep_alive,
        timeout_graceful_shutdown=config.server.shutdown_timeout,
        http=_httptools_protocol() or H11RequestDeadline,
    )
    return uvicorn.Config(app, **{**kwargs, **overrides})


class ClientWarningsPerMinute(logging.Filter):
    """uvicorn warns once per malformed request ("Invalid HTTP request received.", "Unsupported upgrade request."),
    each a line any client can write into the server's log, as fast as it can connect: over a long run, a disk. Each
    such warning passes at most once a minute, saying how many were left out since; errors pass untouched."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self.last: dict[str, float] = {}
        self.left_out: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.exc_info:
            return True
        key, now = record.getMessage(), self.clock()
        if now - self.last.get(key, -self.every_s) < self.every_s:
            self.left_out[key] = self.left_out.get(key, 0) + 1
            return False
        self.last[key] = now
        if left_out := self.left_out.pop(key, 0):
            record.msg, record.args = f"{key} ({left_out} more in the last {self.every_s:g} s)", ()
        return True
