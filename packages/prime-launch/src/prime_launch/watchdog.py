"""The watchdog: finds a process of a run that is alive but stuck, and names it in one line.

Every process writes ``progress/<name>.json`` once a second (``prime_core.progress``): a heartbeat and what it is doing,
each activity with its bound. The inference servers are probed at ``/health`` once a second, each request bounded by
``probe_timeout_s``. ``Watchdog.check`` raises ``ProcessStuck`` when

- a process wrote no heartbeat for ``slack_s`` (SIGSTOP, a frozen host), or none at all within ``startup_s`` of its
  start, or announced that it is exiting and is still there ``slack_s`` later;
- an inference server has not answered ``/health`` for ``slack_s``, or holds running requests while its engine has made
  no step for ``slack_s``;
- an activity runs ``slack_s`` past its bound: the limit the process took from its config (a rollout timeout, a weight
  update timeout; an activity waiting on another process blames that one), else for steps, weight publishes and
  checkpoints a bound learned from the slowest one so far (``LivenessConfig``). A wait on another process without a
  limit is not a fault by itself: the process waited for is watched; but two processes that have waited only on each
  other for ``slack_s`` (a rollouts file gone before the trainer read it) are (``prime_launch.wait_cycle``);
- a sandbox pool (``progress/sandbox_pool_<pid>.json``, written by a pool inside a process of the run) holds running
  executions and finished none for ``slack_s`` past the bound of one execution. The orchestrator replaces the env
  server holding such a pool at the bound itself; this catches a pool nobody replaced.

``rl`` runs it in its loop; ``prime-launch watch`` runs it beside a SLURM job's processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_core.config.liveness import LivenessConfig, WatchConfig
from prime_core.progress import boot_id, read_progress
from prime_core.schemas.health import HealthResponse
from prime_core.schemas.progress import Activity, Progress

from prime_launch.health_probe import HealthProbe
from prime_launch.proc_state import gone, pid_note, process_state, stopped_note
from prime_launch.process import ProcessFailed
from prime_launch.wait_cycle import WaitCycles

if TYPE_CHECKING:
    from prime_core.config.rl import RLConfig
    from prime_core.run_dir import RunDir

    from prime_launch.resolver import ResolvedRun


class ProcessStuck(ProcessFailed):
    """A process (or inference server) that is alive but makes no progress; ``cause`` is one line."""

    def __init__(self, name: str, line: str, log_file: Path | None):
        super().__init__(name, None, log_file or Path("/dev/null"), reason=line)
        self.args = (f"{name} is stuck: {line}",)
        self.line = line
        self.has_log = log_file is not None

    @property
    def cause(self) -> str:
        log = f" (log: {self.log_file})" if self.has_log else ""
        return f"{self.name} is stuck: {self.line}{log}"

    def log_tail(self, num_lines: int = 30) -> str:
        return super().log_tail(num_lines) if self.has_log else ""


@dataclass
class _Watched:
    """A process the watchdog reads: its progress files (one per trainer rank) and since when it runs (wall clock, to
    tell an earlier launch's file of another boot; the watchdog's steady clock, for its startup allowance)."""

    name: str
    files: list[Path]
    started: float
    started_steady: float
    log_file: Path | None = None
    pid: int | None = None
    """The process started (a trainer's launcher: its ranks are its descendants), where the watchdog started it."""


class Watchdog:
    """Reads progress files and probes servers; ``check`` raises ``ProcessStuck`` for the first stuck process."""

    def __init__(
        self,
        config: LivenessConfig,
        run_id: str | None = None,
        clock: Callable[[], float] = time.time,
        exits_known: bool = True,
        steady: Callable[[], float] | None = None,
    ):
        self.config = config
        self.run_id = run_id
        self.clock = clock
        """The wall clock, for records that carry no monotonic time of this boot (another host's)."""
        self.steady = steady or (time.monotonic if clock is time.time else clock)
        """The watchdog's own clock for every interval: a step of the wall clock must neither kill a healthy run nor
        hide a stuck process (a test's fake ``clock`` serves as both)."""
        self.boot_id = boot_id() if self.steady is time.monotonic else ""
        self.exits_known = exits_known
        """Whether ``check`` hears of every process that exited (``rl``); else (``prime-launch watch``) a process that
        announced its exit counts as gone unless it is still alive on this host."""
        self.processes: dict[str, _Watched] = {}
        self.probes: dict[str, HealthProbe] = {}
        self._server_of: dict[str, str | None] = {}
        self._last_check: float | None = None
        self._awake_since: float | None = None
        self._offsets: dict[str, float] = {}
        """Per boot id of another node: its monotonic clock's offset to ``steady`` (``_remote_age``)."""
        self._first_seen: dict[tuple[str, int, float], float] = {}
        """Per writer on another node (boot, pid, start): the monotonic time of its first record read."""
        self._cycles = WaitCycles(self.steady)
        self._seen: dict[Path, Progress] = {}
        """Per progress file, the last record of this launch read from it."""
        self.helpers_dir: Path | None = None
        self._helpers_since = (0.0, 0.0)

    def watch_helpers(self, progress_dir: Path) -> None:
        """Read the progress files of helpers (sandbox pools) that processes of the run start under ``progress_dir``."""
        self.helpers_dir, self._helpers_since = progress_dir, (self.clock(), self.steady())

    def watch(self, name: str, files: Iterable[Path], log_file: Path | None = None, pid: int | None = None) -> None:
        """``name`` was just started (as ``pid``, where known); it writes ``files`` (a trainer: one per rank)."""
        self.processes[name] = _Watched(name, list(files), self.clock(), self.steady(), log_file, pid)
        for path in self.processes[name].files:
            self._seen.pop(path, None)

    def probe(self, urls: Iterable[str], api_key: str | None, server: str | None = None) -> None:
        """Probe each ``/health`` URL from now on; ``server`` names the process serving them (None: external)."""
        for url in urls:
            if url not in self.probes:
                self.probes[url] = HealthProbe(url, api_key, self.config.probe_timeout_s).start()
                self._server_of[url] = server

    def close(self) -> None:
        for probe in self.probes.values():
            probe.stop()

    def resumed(self) -> None:
        """This process was stopped (Ctrl-Z, SIGSTOP) and continued (``SIGCONT``), its probe threads with it: silence
        it slept through is not held against the processes, which ran on in their own sessions; each gets a fresh
        ``slack_s`` from now. Called from a signal handler: it only sets a few floats."""
        now = self.steady()
        self._awake_since = now
        self._cycles.since.clear()
        for probe in self.probes.values():
            probe.last_ok = max(probe.last_ok, time.monotonic())
            if probe.engine_stalled_since is not None:
                probe.engine_stalled_since = time.monotonic()

    def _witnessed(self, seconds: float) -> float:
        """``seconds`` of silence, less what fell before the watchdog last woke from a stop."""
        return seconds if self._awake_since is None else min(seconds, self.steady() - self._awake_since)

    def check(self, finished: Iterable[str] = ()) -> None:
        """Raise ``ProcessStuck`` for the first stuck process, at most once a second; ``finished`` processes exited
        normally and are no longer watched."""
        if not self.config.enabled:
            return
        steady = self.steady()
        if self._last_check is not None and steady - self._last_check < 1.0:
            return
        self._last_check = steady
        done = set(finished)
        for url, probe in self.probes.items():
            server = self._server_of.get(url)
            if server not in done:
                self._check_probe(url, probe, server)
        for watched in self.processes.values():
            if watched.name not in done:
                for path in watched.files:
                    self._check_file(watched, path)
        self._check_wait_cycle(done)
        self._check_helpers()

    def _age(self, record: Progress) -> float:
        """Seconds since ``record``'s heartbeat, never on a wall clock where the writer says its monotonic time: this
        boot's, or another node's (``_remote_age``); a wall-clock step or skew on either node moves neither."""
        if record.on_clock_of(self.boot_id):
            assert record.monotonic is not None
            return self.steady() - record.monotonic
        if record.monotonic is not None and record.boot_id:
            return self._remote_age(record.boot_id, record.monotonic)
        return self.clock() - record.time

    def _remote_age(self, boot: str, monotonic: float) -> float:
        """Age of a record written at ``monotonic`` on boot ``boot`` (another node), in this watchdog's clock. The two
        monotonic clocks differ by a fixed offset; every read bounds it (a record read now was written no later than
        now), and the tightest bound over all reads of that boot's records is kept. Heartbeats come every second, so
        ages are right to about a second; a record first read long after it was written counts from that read, so a
        process already stopped when watching began is named one ``slack_s`` later."""
        now = self.steady()
        offset = min(self._offsets.get(boot, now - monotonic), now - monotonic)
        self._offsets[boot] = offset
        return now - monotonic - offset

    def _since_start(self, record: Progress, wall: float, steady: float) -> bool:
        """Whether ``record`` was written after the moment (``wall``, ``steady``) less 2 s: by this launch's process,
        not left by an earlier one. Another node's record counts once its writer has written again since the first
        read (a live writer, whatever that node's wall clock says), else by the wall clock."""
        if record.on_clock_of(self.boot_id):
            return self._age(record) <= self.steady() - steady + 2.0
        if record.monotonic is not None and record.boot_id:
            first = self._first_seen.setdefault((record.boot_id, record.pid, record.started), record.monotonic)
            if record.monotonic > first:
                return True
        return record.time >= wall - 2.0

    def _lasted(self, record: Progress, a: Activity) -> float:
        """How long activity ``a`` of ``record`` has lasted by now."""
        if a.for_s is not None:
            return a.for_s + max(0.0, self._age(record))
        return self.clock() - a.since

    # ----- servers -----
    def _check_probe(self, url: str, probe: HealthProbe, server: str | None) -> None:
        slack = self.config.slack_s
        now = time.monotonic()
        name = server or f"the inference server at {url.removesuffix('/health')}"
        log = self.processes[server].log_file if server in self.processes else None
        pid = self._server_pid(server)
        where = f" ({pid_note(pid)})" if pid else ""
        if now - probe.last_ok > slack:
            asked = probe.asked_at
            error = f"the last request has waited {now - asked:.0f} s" if asked is not None else probe.error
            line = f"{url} has not answered for {now - probe.last_ok:.0f} s ({error}){where}"
            raise ProcessStuck(name, line + _serving(probe.answer), log)
        stalled = probe.engine_stalled_since
        if stalled is not None and now - stalled > slack and probe.answer is not None:
            a = probe.answer
            line = (
                f"its engine made no step for {now - stalled:.0f} s with {a.running} requests running and {a.waiting} "
                f"waiting (weights step {a.weight_step}){where}"
            )
            raise ProcessStuck(name, line, log)

    def _server_pid(self, server: str | None) -> int | None:
        watched = self.processes.get(server) if server else None
        for path in watched.files if watched else []:
            record = self._fresh(path, watched)
            if record is not None:
                return record.pid
        return None

    # ----- progress files -----
    def _fresh(self, path: Path, watched: _Watched) -> Progress | None:
        """The record of this launch (a file left by an earlier launch, or another run's, is ignored). Once one was
        read, a path with none (deleted, replaced by a bad file) keeps its last, ageing record: before, one read of a
        missing file named a process that wrote a second ago as one that `wrote no heartbeat` (`benchmarks/chaos.py`)."""
        record = read_progress(path)
        if record is None or not self._since_start(record, watched.started, watched.started_steady):
            return self._seen.get(path)
        if self.run_id is not None and record.run_id is not None and record.run_id != self.run_id:
            return self._seen.get(path)
        self._seen[path] = record
        return record

    def _check_file(self, watched: _Watched, path: Path) -> None:
        slack = self.config.slack_s
        record = self._fresh(path, watched)
        if record is None:
            running = self._witnessed(self.steady() - watched.started_steady)
            if running > self.config.startup_s:
                line = f"it wrote no heartbeat to {path} in the {running:.0f} s since it started{stopped_note(watched.pid)}"
                raise ProcessStuck(watched.name, line, watched.log_file)
            return
        label, pid = record.name, pid_note(record.pid, record.host)
        age = self._witnessed(self._age(record))
        if record.exiting:
            if age > slack and (self.exits_known or process_state(record.pid, record.host) is not None):
                line = f"{label} finished its work {age:.0f} s ago but has not exited ({pid})"
                raise ProcessStuck(watched.name, line, watched.log_file)
            return
        # A server being probed is judged by its /health answers (a bounded request that says what it served).
        if age > slack and watched.name not in self._server_of.values():
            line = f"{label} sent no heartbeat for {age:.0f} s ({pid}); it was {record.doing()}"
            raise ProcessStuck(watched.name, line, watched.log_file)
        for activity in record.activities:
            bound = self.bound(record, activity)
            elapsed = self._lasted(record, activity)
            if bound is not None and elapsed > bound + slack:
                self._overdue(watched, record, activity, elapsed, bound)

    def _overdue(self, watched: _Watched, record: Progress, a: Activity, elapsed: float, bound: float) -> None:
        line = (
            f"{record.name} has been {a.what} for {elapsed:.0f} s, past its bound of {bound:.0f} s "
            f"+ {self.config.slack_s:.0f} s slack"
        )
        blamed = a.waits_for or watched.name
        log = self.processes[blamed].log_file if blamed in self.processes else watched.log_file
        raise ProcessStuck(blamed, line, log)

    def _check_wait_cycle(self, done: set[str]) -> None:
        """Two processes waiting only on each other (``prime_launch.wait_cycle``): neither wait is bounded alone. The
        records are those ``_check_file`` just read (``_fresh`` keeps each file's last in ``_seen``)."""
        records = {
            w.name: [r for path in w.files if (r := self._seen.get(path)) is not None]
            for w in self.processes.values()
            if w.name not in done
        }
        if (found := self._cycles.check(records, self.config.slack_s)) is not None:
            raise ProcessStuck(found[0], found[1], self.processes[found[0]].log_file)

    def _check_helpers(self) -> None:
        if self.helpers_dir is None:
            return
        slack = self.config.slack_s
        for path in sorted(self.helpers_dir.glob("sandbox_pool_*.json")):
            record = read_progress(path)
            # Another launch's (an earlier run's file in progress/: another run id, or none where this launch stamps
            # its processes), or a process that is gone (a replaced env server: its last record stays fresh for
            # ``slack_s``) or frozen (the orchestrator's env watch kills that one): only a live pool's overdue work is
            # a fault here.
            if (
                record is None
                or record.exiting
                or (self.run_id is not None and record.run_id != self.run_id)
                or self._age(record) > slack
                or not self._since_start(record, *self._helpers_since)
                or gone(record)
            ):
                continue
            for a in record.activities:
                if a.limit_s is not None and (lasted := self._lasted(record, a)) > a.limit_s + slack:
                    c = record.counters
                    line = (
                        f"the sandbox pool ({pid_note(record.pid, record.host)}) has been {a.what} for "
                        f"{lasted:.0f} s without one finishing, past its bound of {a.limit_s:.0f} s + {slack:.0f} s "
                        f"slack ({c.get('executions_completed', 0):.0f} executions completed, "
                        f"{c.get('zygotes_replaced', 0):.0f} zygotes replaced)"
                    )
                    owner = self.processes.get("orchestrator")
                    raise ProcessStuck("sandbox pool", line, owner.log_file if owner else None)

    def bound(self, record: Progress, a: Activity) -> float | None:
        """Longest ``a`` may take before the slack: its own limit; a learned one for its kind; None for an unlimited
        wait on another process (watched itself)."""
        if a.limit_s is not None:
            return a.limit_s
        if a.waits_for is not None or not a.kind:
            return None
        c = self.config
        if c.step_timeout_s is not None:
            return c.step_timeout_s
        slowest = record.slowest_s.get(a.kind)
        if slowest is None:
            return c.first_timeout_s
        return max(c.learned_floor_s, c.learned_factor * slowest)


def _serving(answer: HealthResponse | None) -> str:
    if answer is None:
        return ""
    return (
        f"; it last served weights step {answer.weight_step} with {answer.running} requests running and "
        f"{answer.waiting} waiting"
    )


def progress_files(plan: ResolvedRun) -> dict[str, list[Path]]:
    """Per process of a launch plan, the progress files it writes (the trainer: one per rank)."""
    from prime_core.run_dir import RunDir

    from prime_launch.plan import role

    files: dict[str, list[Path]] = {}
    ranks = 1
    for name, cfg in plan.configs.items():
        if role(name) == "orchestrator":
            files[name] = [RunDir(cfg.output_dir).progress_file("orchestrator")]
            ranks = cfg.num_trainer_ranks
        elif name == "inference":
            files[name] = [plan.run_dir.progress_file("inference")]
        elif name == "teacher":  # an inference process in its own run subdirectory
            files[name] = [RunDir(cfg.output_dir).progress_file("inference")]
    files["trainer"] = [plan.run_dir.progress_file("trainer", rank) for rank in range(ranks)]
    return files


class RunWatchdog(Watchdog):
    """The watchdog of one ``rl`` launch: knows each process's progress files and log, and that its output
    directories stay in place (``OutputDirGone``, liveness enabled or not)."""

    def __init__(self, plan: ResolvedRun, config: LivenessConfig):
        from prime_launch.run_lock import OutputDirWatch

        run_id = next((spec.env.get("PRIME_RUN_ID") for spec in plan.specs), None)
        super().__init__(config, run_id)
        self.files = progress_files(plan)
        self.logs = {spec.name: spec.log_file for spec in plan.specs}
        self.watch_helpers(plan.run_dir.progress)
        self.dirs = OutputDirWatch(plan.run_dir.root, [d.root for d in plan.runs.values()])

    def started(self, name: str, pid: int | None = None) -> None:
        self.watch(name, self.files.get(name, []), self.logs.get(name), pid)

    def check(self, finished: Iterable[str] = ()) -> None:
        self.dirs.check()
        super().check(finished)


class RunEnded(Exception):
    """The run ``prime-launch watch`` was pointed at had ended before the watch began (``prime_launch.run_end``):
    ``code`` 0 when it finished, 1 when it stopped before; ``line`` says which."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code, self.line = code, line


def watch_forever(config: WatchConfig, poll_s: float = 0.5) -> None:
    """``prime-launch watch``: check until a process is stuck (``ProcessStuck``) or SIGTERM/SIGINT (return);
    ``RunEnded`` at once for a run that had ended before."""
    import os
    import signal

    from prime_core.run_dir import RunDir

    from prime_launch.run_end import ended

    run_dir = RunDir(config.output_dir)
    dog = Watchdog(config.liveness, os.environ.get("PRIME_RUN_ID"), exits_known=False)
    if config.orchestrator:
        dog.watch("orchestrator", [run_dir.progress_file("orchestrator")], run_dir.log_file("orchestrator"))
    if config.trainer_ranks:
        ranks = [run_dir.progress_file("trainer", r) for r in range(config.trainer_ranks)]
        dog.watch("trainer", ranks, run_dir.log_file("trainer"))
    if (outcome := ended({w.name: w.files for w in dog.processes.values()}, dog.run_id, run_dir)) is not None:
        raise RunEnded(*outcome)
    api_key = os.environ.get(config.api_key_var) if config.api_key_var else None
    dog.probe(config.health_urls, api_key)
    dog.watch_helpers(run_dir.progress)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGCONT, lambda *_: dog.resumed())
    print(
        f"watching {', '.join(dog.processes)} and {len(dog.probes)} inference server(s) (slack {config.liveness.slack_s:g} s)",
        flush=True,
    )
    try:
        while not stop.wait(poll_s):
            dog.check()
    finally:
        dog.close()


def watch_context(rl: RLConfig, run_dir: RunDir) -> dict[str, object]:
    """Template variables of a multi-node SLURM job: ``prime-launch watch``'s liveness flags, and the step a resumed
    job rewinds to before it starts anything (None: a fresh run)."""
    from prime_launch.host import resumable_steps

    resume_step = rl.trainer.ckpt.resume_step
    if rl.resume and resume_step is None:
        steps = resumable_steps(rl, run_dir.root)
        resume_step = steps[-1] if steps else None
    config = rl.liveness
    flags = [
        f"--liveness.{name.replace('_', '-')} {value}"
        for name, value in config.model_dump().items()
        if value is not None and name != "enabled"
    ]
    return {"watch_args": " ".join(flags), "watch_enabled": config.enabled, "resume_step": resume_step}
