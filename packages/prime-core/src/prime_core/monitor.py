"""Per-step metric sinks: metrics.jsonl (always safe to tail) and W&B."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prime_core.config.shared import MonitorConfig, WandbConfig
from prime_core.io import UnreadableFile, open_regular, writing
from prime_core.schemas.metrics import MetricsRecord

logger = logging.getLogger(__name__)

WANDB_FINISH_TIMEOUT_S = 60.0
"""How long closing waits for W&B to upload what it holds: a W&B that stopped answering must not keep a finished run
from exiting (the run's W&B files stay in its directory for ``wandb sync``)."""


class MonitorUnavailable(RuntimeError):
    """A configured metrics sink could not start; the message is one line meant for the console."""


class Monitor(Protocol):
    def log(self, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlMonitor:
    """Appends one ``MetricsRecord`` line per call; each line is written with a single ``write``."""

    def __init__(self, path: str | Path, process: str):
        self.path = Path(path)
        self.process = process
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self.path.is_file():  # a FIFO: appending would wait in open for a reader
            raise MonitorUnavailable(f"{self.path}: not a regular file (metrics are appended to one): remove it")
        # A line a full disk cut short (this run's, or the stopped run's this one resumes) stays a torn line of its
        # own: the next record starts on a new line. Checked here and after a short write of ours, not per line:
        # the other process's append may be in flight, and a spurious empty line is harmless, a glued record not.
        self._torn = _ends_torn(self.path)

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = MetricsRecord(step=step, process=self.process, values=_jsonable(values))
        line = (record.model_dump_json() + "\n").encode()
        # O_APPEND writes of one line are atomic w.r.t. other appenders (trainer and orchestrator share it).
        with writing(f"metrics of step {step}", self.path):
            if self._torn:
                line = b"\n" + line
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                self._torn = 0 < written < len(line)
                if written != len(line):  # a full disk takes part of a write without an error
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            finally:
                os.close(fd)

    def close(self) -> None:
        pass


def _ends_torn(path: Path) -> bool:
    try:
        with open_regular(path) as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:  # missing or empty
        return False


class WandbMonitor:
    """Logs to W&B; imported only when enabled. W&B is a side channel of a run that may last days: once it fails
    (its service process died, its server stopped answering) it is switched off with one warning and the run goes
    on, its metrics still in metrics.jsonl."""

    _open: set[WandbMonitor] = set()  # this process's monitors not yet closed (multi-tenant runs share W&B's service)

    def __init__(
        self, config: WandbConfig, process: str, run_config: dict[str, Any] | None = None, dir: Path | None = None
    ):
        try:
            import wandb
        except Exception as e:  # missing, or its own import failing (a protobuf or pydantic it does not support)
            missing = isinstance(e, ModuleNotFoundError) and e.name == "wandb"
            why = "is not installed" if missing else f"does not import ({type(e).__name__}: {_first_line(e)})"
            raise MonitorUnavailable(
                f"monitor.wandb.enabled is set but wandb {why}: pip install 'prime-core[wandb]', or set "
                "monitor.wandb.enabled = false"
            ) from None
        name = f"{config.name}-{process}" if config.name else None
        self._dir, self._failed = dir, False
        try:
            self._run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=name,
                group=config.group,
                tags=config.tags,
                mode="offline" if config.offline else "online",
                config=run_config,
                dir=str(dir) if dir else None,
                reinit="create_new",
            )
        except Exception as e:  # no network, a server that does not answer, a bad key: wandb's own errors
            raise MonitorUnavailable(
                f"W&B did not start ({_first_line(e)}): set monitor.wandb.offline to log locally and `wandb sync` "
                "later, or monitor.wandb.enabled = false"
            ) from None
        WandbMonitor._open.add(self)

    def log(self, step: int, values: dict[str, Any]) -> None:
        # Scalars as metrics.jsonl takes them (NumPy, torch: `.item()`): the filter alone dropped those silently.
        numbers = {k: v for k, v in ((k, _scalar(v)) for k, v in values.items()) if isinstance(v, int | float)}
        self._call(step, lambda run: run.log(numbers, step=step))

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        import wandb

        self._call(step, lambda run: run.log({name: wandb.Table(columns=columns, data=rows)}, step=step))

    def _call(self, step: int, call: Any) -> None:
        if self._run is None:
            return
        try:
            call(self._run)
        except Exception as e:
            self._run, self._failed = None, True
            logger.warning("W&B logging stopped at step %d (%s); metrics go on in metrics.jsonl", step, _first_line(e))

    def close(self) -> None:
        run, self._run = self._run, None
        WandbMonitor._open.discard(self)
        if run is not None:
            self._finish(run)
        if self._failed and not WandbMonitor._open:
            _teardown_quietly()

    def _finish(self, run: Any) -> None:
        """``run.finish()`` uploads what W&B still holds: bounded, as a server that stopped answering would keep it
        forever (the service is then left to the process's exit)."""
        failed: list[BaseException] = []
        closing = threading.Thread(target=_run_finish, args=(run, failed), name="wandb-finish", daemon=True)
        closing.start()
        closing.join(WANDB_FINISH_TIMEOUT_S)
        where = f" ({self._dir / 'wandb'}; `wandb sync` uploads it)" if self._dir else ""
        if closing.is_alive():
            logger.warning("W&B did not finish uploading within %g s%s", WANDB_FINISH_TIMEOUT_S, where)
        elif failed:
            self._failed = True
            logger.warning("W&B did not finish (%s)%s", _first_line(failed[0]), where)


def _run_finish(run: Any, failed: list[BaseException]) -> None:
    try:
        run.finish()
    except BaseException as e:  # reported by close(); a thread's traceback would bypass the one-line rule
        failed.append(e)


def _teardown_quietly() -> None:
    """Close the connection to W&B's service after it failed, once no other run uses it: its exit hook would print
    the broken connection's traceback as the process exits."""
    import wandb

    with contextlib.suppress(Exception):
        wandb.teardown()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class MultiMonitor:
    def __init__(self, monitors: list[Any]):
        self.monitors = monitors

    def log(self, step: int, values: dict[str, Any]) -> None:
        for m in self.monitors:
            m.log(step, values)

    def close(self) -> None:
        for m in self.monitors:
            m.close()


def build_monitor(
    config: MonitorConfig, *, output_dir: str | Path, process: str, run_config: dict[str, Any] | None = None
) -> MultiMonitor:
    monitors: list[Any] = []
    if config.jsonl:
        monitors.append(JsonlMonitor(Path(output_dir) / "metrics.jsonl", process))
    if config.wandb.enabled:
        monitors.append(WandbMonitor(config.wandb, process, run_config, dir=Path(output_dir)))
    return MultiMonitor(monitors)


METRICS_BYTES = 4 << 30
"""The most of metrics.jsonl read at once (`read_metrics`, and ``rl --resume`` setting records aside): a million steps
of a run logging 4 KiB of records a step. A file of 10 GiB there (a sparse one, another file copied over it) was read
whole into memory."""
METRICS_LINE_BYTES = 1 << 20
"""The longest line read as a record (a real one is a few KiB); a longer one is skipped like a torn line, without
holding it: one line of 512 MiB (no newline) took 1 GiB of memory to read and try."""
TAIL_READ_BYTES = 8 << 20
"""The most one `MetricsTail.read` reads: the backlog of a resumed run's file is caught up over several polls instead
of stalling the launcher's loop (which also watches the processes) for as long as reading all of it takes."""
_NOT_REGULAR = (errno.EINVAL, errno.EISDIR, errno.ENXIO, errno.ELOOP)  # as `prime_core.io.read_regular` names them


def read_metrics(path: str | Path, process: str | None = None) -> list[MetricsRecord]:
    """Read metrics.jsonl, optionally only one process's records; a torn, foreign or over-long line is skipped, a
    missing file has none. A file over `METRICS_BYTES` (refused by its size, before any of it is read) or not a regular
    file (a FIFO in its place, whose ``open`` waited for good) is an `UnreadableFile` naming it in one line."""
    return [r for r in iter_metrics(path) if process is None or r.process == process]


def iter_metrics(path: str | Path) -> Iterator[MetricsRecord]:
    """`read_metrics`, one record at a time: a reader that keeps a few values of each record holds only those (a long
    run's whole file, parsed at once, is gigabytes). A disk failing in the middle ends the records there."""
    try:
        with open_regular(path) as f:
            if (size := os.fstat(f.fileno()).st_size) > METRICS_BYTES:
                raise UnreadableFile(f"{path}: over {METRICS_BYTES} bytes ({size}), too large for a metrics file")
            for line in _lines(f, METRICS_BYTES):
                if (record := _parse(line)) is not None:
                    yield record
    except OSError as e:
        if e.errno in _NOT_REGULAR:
            raise UnreadableFile(f"{path}: not a regular file (a metrics file is one)") from None
        return  # missing (not written yet), or a failing disk: no more records


def _lines(f: Any, budget: int) -> Any:
    """The lines of ``f`` within ``budget`` bytes (a file that grows while read), each read with a bound: a line over
    `METRICS_LINE_BYTES` is read past in pieces of that size, never held whole."""
    skipping = False
    while budget > 0 and (piece := f.readline(min(METRICS_LINE_BYTES + 1, budget))):
        budget -= len(piece)
        ended = piece.endswith(b"\n")
        if not skipping and (ended or len(piece) <= METRICS_LINE_BYTES):
            yield piece
        skipping = not ended


class MetricsTail:
    """Follows a metrics file: ``read()`` returns the complete records appended since the previous call (a line
    still being written waits for its end). It never blocks and holds little: at most `TAIL_READ_BYTES` per call, a
    partial line up to `METRICS_LINE_BYTES` (a longer one is skipped to its end); a FIFO in the file's place is
    refused with one warning and read as no records; a file replaced or cut shorter is followed from its start."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line over the cap: what comes before its newline is dropped
        self._file: tuple[int, int] | None = None
        self._refused = False

    def read(self) -> list[MetricsRecord]:
        try:
            with open_regular(self.path) as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._file or st.st_size < self._offset:
                    self._file, self._offset, self._partial, self._skipping = (st.st_dev, st.st_ino), 0, b"", False
                f.seek(self._offset)
                chunk = f.read(TAIL_READ_BYTES)
                self._offset += len(chunk)
        except OSError as e:
            if e.errno in _NOT_REGULAR and not self._refused:
                logger.warning("%s: not a regular file (a metrics file is one); no metrics are shown", self.path)
                self._refused = True
            return []
        self._refused = False
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if self._skipping and lines:  # the over-long line's end
            lines.pop(0)
            self._skipping = False
        if self._skipping or len(self._partial) > METRICS_LINE_BYTES:
            self._partial, self._skipping = b"", True
        return [r for line in lines if len(line) <= METRICS_LINE_BYTES and (r := _parse(line)) is not None]


def _parse(line: bytes) -> MetricsRecord | None:
    if not line.strip():
        return None
    try:
        return MetricsRecord.model_validate_json(line)
    except ValueError:
        return None


def _scalar(value: Any) -> Any:
    """A NumPy or torch scalar as its Python number; anything else (an array of several values too) as it is."""
    if hasattr(value, "item") and not isinstance(value, int | float | str):
        with contextlib.suppress(ValueError, RuntimeError, TypeError):  # not one value
            return value.item()
    return value


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        v = _scalar(v)
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            v = None
        out[k] = v if isinstance(v, int | float | str) or v is None else json.dumps(v)
    return out
