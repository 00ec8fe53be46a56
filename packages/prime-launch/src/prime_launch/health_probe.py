"""One inference server's ``/health``, asked once a second in a thread: when it last answered, and whether its engine
still steps while it holds requests (the watchdog judges both against its slack)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prime_core.schemas.health import HealthResponse, parse_health


@dataclass
class HealthProbe:
    """Probes one server's ``/health`` every second in a thread; each request is bounded by ``timeout_s``."""

    url: str
    api_key: str | None
    timeout_s: float
    last_ok: float = field(default_factory=time.monotonic)
    answer: HealthResponse | None = None
    error: str = "no answer yet"
    engine_stalled_since: float | None = None
    asked_at: float | None = None
    """When the request in flight was sent (None between requests)."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> HealthProbe:
        threading.Thread(target=self._loop, name=f"probe {self.url}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.once()
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))

    def once(self) -> None:
        request = urllib.request.Request(self.url)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        self.asked_at = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.error = _describe(e, self.timeout_s)
            return
        finally:
            self.asked_at = None
        answer = parse_health(data)
        now = time.monotonic()
        before = self.answer
        # Only an engine that counts its steps, is not paused and holds requests can be seen stalling.
        idle = answer.running == 0 or answer.engine_steps is None or answer.paused
        if idle or before is None or answer.engine_steps != before.engine_steps or self.engine_stalled_since is None:
            self.engine_stalled_since = None if idle else now
        self.answer, self.last_ok = answer, now


def _describe(error: Exception, timeout_s: float) -> str:
    if isinstance(error, TimeoutError) or "timed out" in str(error):
        return f"each request timed out after {timeout_s:g} s"
    reason = getattr(error, "reason", error)
    return f"{type(reason).__name__}: {reason}".splitlines()[0][:200]
