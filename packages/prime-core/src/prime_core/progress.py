"""A process's heartbeat and activities, written for the launcher's watchdog (schema: ``prime_core.schemas.progress``).

An entry point calls ``start_reporting(output_dir, "trainer", rank=...)`` right after parsing its config, before the
heavy imports (a process that hangs while importing is seen too); code anywhere in the process then says what it does:

    with progress.activity("training step 3", kind="step"):
        ...
    progress.begin("waiting for weights step 4", lane="rollouts", waits_for="trainer")
    progress.end("rollouts")

A background thread rewrites ``progress/<name>.json`` every ``HEARTBEAT_INTERVAL_S``, so the heartbeat stops only when
the whole process stops (SIGSTOP, a frozen host), and logs a line for every activity that lasts longer than
``NOTICE_EVERY_S`` (what the process is waiting for, and for how long). Reporting never raises: a full disk must not
kill a process through its heartbeat. Without ``start_reporting`` (tests, library use) every call is a no-op.

``start_reporting`` also exports ``PRIME_PROGRESS_DIR``, so helpers that a process of the run starts (an env server's
workers and the sandbox pool each one may hold) report beside it: ``helper_reporter("sandbox_pool")`` writes
``progress/sandbox_pool_<pid>.json``, which the launcher's watchdog and the orchestrator's env watch read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prime_core.io import atomic_write_text, open_regular
from prime_core.run_dir import RunDir
from prime_core.schemas.progress import HEARTBEAT_INTERVAL_S, Activity, Progress

logger = logging.getLogger("prime.progress")

NOTICE_EVERY_S = 60.0
"""An activity running longer than this gets a log line saying what the process waits for, and again as often."""
PROGRESS_DIR_VAR = "PRIME_PROGRESS_DIR"
"""The run's ``progress/`` directory, exported by ``start_reporting`` to every process the reporting one starts."""

CounterSource = Callable[[], dict[str, float]]


@functools.cache
def boot_id() -> str:
    """This host's boot id (``Progress.boot_id``), empty where the kernel has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class ProgressReporter:
    """The state behind one progress file; thread-safe (asyncio tasks and threads report, a thread writes)."""

    def __init__(self, path: Path | None, process: str, *, rank: int | None = None, run_id: str | None = None):
        self.path = path
        now = time.time()
        self._progress = Progress(
            process=process, rank=rank, pid=os.getpid(), host=socket.gethostname(), run_id=run_id, started=now, time=now
        )
        self._activities: dict[str, Activity] = {}
        # Durations on the monotonic clock, by lane: a step of the wall clock moves every ``since``, not these.
        self._began: dict[str, float] = {}
        self._noticed: dict[str, float] = {}
        self._sources: list[CounterSource] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_failed = False

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self) -> ProgressReporter:
        if self.enabled and self._thread is None:
            self.write()
            self._thread = threading.Thread(target=self._beat, name="prime-progress", daemon=True)
            self._thread.start()
        return self

    def begin(
        self,
        what: str,
        *,
        lane: str = "main",
        kind: str = "",
        limit_s: float | None = None,
        waits_for: str | None = None,
    ) -> None:
        """Start (or replace) the activity of ``lane``."""
        activity = Activity(lane=lane, what=what, kind=kind, since=time.time(), limit_s=limit_s, waits_for=waits_for)
        with self._lock:
            self._activities[lane] = activity
            self._began[lane] = time.monotonic()
            self._noticed.pop(lane, None)

    def touch(self, lane: str = "main", what: str | None = None, limit_s: float | None = None) -> None:
        """The activity of ``lane`` made progress (a rollout finished): its clock restarts."""
        with self._lock:
            current = self._activities.get(lane)
            if current is not None:
                update = {"since": time.time(), **({"what": what} if what is not None else {})}
                update |= {"limit_s": limit_s} if limit_s is not None else {}
                self._activities[lane] = current.model_copy(update=update)
                self._began[lane] = time.monotonic()
                self._noticed.pop(lane, None)

    def describe(self, lane: str, what: str, limit_s: float | None = None) -> None:
        """New words (and bound) for the activity of ``lane`` without restarting its clock (more work joined it: no
        progress)."""
        with self._lock:
            current = self._activities.get(lane)
            if current is not None:
                update = {"what": what, **({"limit_s": limit_s} if limit_s is not None else {})}
                self._activities[lane] = current.model_copy(update=update)

    def end(self, lane: str = "main") -> None:
        """``lane`` is idle; a kind's duration is remembered for the watchdog's learned bound."""
        with self._lock:
            done = self._activities.pop(lane, None)
            began = self._began.pop(lane, None)
            if done is not None and done.kind and began is not None:
                took = time.monotonic() - began
                slowest = self._progress.slowest_s
                slowest[done.kind] = max(slowest.get(done.kind, 0.0), took)

    @contextlib.contextmanager
    def activity(self, what: str, **kwargs) -> Iterator[None]:
        lane = kwargs.get("lane", "main")
        self.begin(what, **kwargs)
        try:
            yield
        finally:
            self.end(lane)

    def set_step(self, step: int) -> None:
        with self._lock:
            self._progress.step = step

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._progress.counters[name] = self._progress.counters.get(name, 0) + n

    def add_counters(self, source: CounterSource) -> None:
        """``source()`` is read at every heartbeat (e.g. an engine's running requests and steps)."""
        self._sources.append(source)

    def snapshot(self) -> Progress:
        counters: dict[str, float] = {}
        for source in self._sources:
            try:
                counters.update(source())
            except Exception:  # a counter must never stop the heartbeat
                logger.debug("progress counter source failed", exc_info=True)
        with self._lock:
            mono = time.monotonic()
            activities = [
                a.model_copy(update={"for_s": mono - self._began[lane]}) if lane in self._began else a
                for lane, a in self._activities.items()
            ]
            return self._progress.model_copy(
                update={
                    "time": time.time(),
                    "monotonic": mono,
                    "boot_id": boot_id(),
                    "activities": activities,
                    "counters": {**self._progress.counters, **counters},
                    "slowest_s": dict(self._progress.slowest_s),
                },
                deep=True,
            )

    def write(self) -> None:
        if self.path is None:
            return
        try:
            atomic_write_text(self.path, self.snapshot().model_dump_json() + "\n", fsync=False)
            self._write_failed = False
        except OSError as e:
            if not self._write_failed:
                logger.warning("cannot write the progress file %s: %s", self.path, e)
            self._write_failed = True

    def close(self, remove: bool = False) -> None:
        """The process finished: say so (a process that then fails to exit is found), stop the heartbeat. A helper
        that ends before its process (a closed sandbox pool) removes its file instead."""
        with self._lock:
            self._progress.exiting = True
            self._activities.clear()
            self._began.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if remove and self.path is not None:
            self.path.unlink(missing_ok=True)
        else:
            self.write()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            self.write()
            self._notice()

    def _notice(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [
                (a, now - began)
                for lane, a in self._activities.items()
                if (began := self._began.get(lane)) is not None
                and now - began >= NOTICE_EVERY_S
                and now - self._noticed.get(lane, began) >= NOTICE_EVERY_S
            ]
            for a, _ in due:
                self._noticed[a.lane] = now
        for a, lasted in due:
            bound = f" (limit {a.limit_s:.0f} s)" if a.limit_s is not None else ""
            logger.info("%s: still %s after %.0f s%s", self._progress.name, a.what, lasted, bound)


_current = ProgressReporter(None, "process")


def start_reporting(output_dir: str | os.PathLike, process: str, *, rank: int | None = None) -> ProgressReporter:
    """Start this process's heartbeat in ``<output_dir>/progress/``; later calls return the running reporter."""
    global _current
    if not _current.enabled:
        path = RunDir(output_dir).progress_file(process, rank)
        _current = ProgressReporter(path, process, rank=rank, run_id=os.environ.get("PRIME_RUN_ID")).start()
        os.environ[PROGRESS_DIR_VAR] = str(path.parent.absolute())
    return _current


def helper_file(kind: str, pid: int, directory: str | os.PathLike | None = None) -> Path | None:
    """``<progress dir>/<kind>_<pid>.json`` of a helper (None outside a run: no ``PRIME_PROGRESS_DIR``)."""
    directory = directory or os.environ.get(PROGRESS_DIR_VAR)
    return Path(directory) / f"{kind}_{pid}.json" if directory else None


def helper_reporter(kind: str) -> ProgressReporter:
    """A reporter (not started) for a helper of this process, ``kind`` (``sandbox_pool``), writing
    ``progress/<kind>_<pid>.json`` in a run; disabled (every call a no-op) outside one."""
    return ProgressReporter(helper_file(kind, os.getpid()), kind, run_id=os.environ.get("PRIME_RUN_ID"))


def current() -> ProgressReporter:
    return _current


def begin(what: str, **kwargs) -> None:
    _current.begin(what, **kwargs)


def touch(lane: str = "main", what: str | None = None) -> None:
    _current.touch(lane, what)


def describe(lane: str, what: str) -> None:
    _current.describe(lane, what)


def end(lane: str = "main") -> None:
    _current.end(lane)


def activity(what: str, **kwargs) -> contextlib.AbstractContextManager[None]:
    return _current.activity(what, **kwargs)


def count(name: str, n: float = 1) -> None:
    _current.count(name, n)


def set_step(step: int) -> None:
    _current.set_step(step)


def stop_reporting() -> None:
    """Write the final ``exiting`` record and stop the heartbeat thread."""
    global _current
    _current.close()
    _current = ProgressReporter(None, "process")


def lasted(record: Progress, activity: Activity) -> float:
    """How long ``activity`` of ``record`` (written on this host) has lasted by now: on the monotonic clock when the
    writer says, so that a step of the wall clock moves nothing; else since its wall-clock ``since``."""
    if activity.for_s is not None and record.on_clock_of(boot_id()):
        assert record.monotonic is not None
        return activity.for_s + max(0.0, time.monotonic() - record.monotonic)
    return time.time() - activity.since


def read_progress(path: str | os.PathLike) -> Progress | None:
    """A progress file, or None when it is missing or unreadable (being replaced, another version, not a regular file,
    larger than a record can be)."""
    try:
        with open_regular(path) as f:
            data = f.read(_MAX_RECORD_BYTES + 1)
        if len(data) > _MAX_RECORD_BYTES:
            return None
        return Progress.model_validate_json(data)
    except (OSError, ValueError):
        return None


_MAX_RECORD_BYTES = 1 << 20
"""A record is a few kB; what is larger was not written by a process of the run and is not read whole every second."""
