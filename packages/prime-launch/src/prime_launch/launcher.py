"""The local ``rl`` launch: write configs, start inference, wait for health, start orchestrator and trainer,
show progress, and stop everything when the trainer finishes, a process fails, or the user interrupts."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TextIO

from prime_core.config import write_config
from prime_core.config.rl import RLConfig
from prime_core.io import UnreadableFile, open_regular
from prime_core.run_dir import RunDir, clear_run
from prime_core.schemas.weights import ChangedWeights, verify_weights
from prime_core.transport import new_transport_secret

from prime_launch.dry_check import check_orchestrators
from prime_launch.host import gather_host_facts
from prime_launch.metrics import MetricsFollower, format_run_line, format_summary, summarize
from prime_launch.plan import DRY_RUN_MARKER, check_output_dir, command_line, existing_artifacts
from prime_launch.process import ProcessFailed, ProcessManager, full_disk_note, tail_lines
from prime_launch.resolver import ResolvedRun, resolve
from prime_launch.resume import rewind
from prime_launch.run_lock import lock_output_dir
from prime_launch.servers import StartupFailed, check_port_free, check_served_model, reset_to_base, wait_healthy
from prime_launch.watchdog import RunWatchdog

POLL_S = 0.2
ECHO_BYTES = 1 << 20
"""Log bytes of each process ``console = "logs"`` echoes per tick, at most."""


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def resolve_here(
    rl: RLConfig, environ: Mapping[str, str] | None = None, *, run_id: str | None = None, cores: int | None = None
) -> ResolvedRun:
    """Resolve ``rl`` on this machine: its facts gathered (``environ``, ``cores`` default to the launcher's), then the
    pure resolver."""
    return resolve(rl, gather_host_facts(rl, environ, run_id=run_id, cores=cores))


def write_configs(plan: ResolvedRun, *, dry_run: bool) -> dict[str, Path]:
    paths = {}
    plan.run_dir.configs.mkdir(parents=True, exist_ok=True)
    for name, cfg in plan.configs.items():
        paths[name] = write_config(cfg, plan.run_dir.config_file(name))
    marker = plan.run_dir.configs / DRY_RUN_MARKER
    if dry_run:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)
    return paths


def check_output_dirs(plan: ResolvedRun, rl: RLConfig) -> None:
    """The shared output directory and every run's directory must be fresh, resumed or overwritten."""
    resume = rl.resume or plan.resume_step is not None
    resumable = bool(plan.run_dir.resumable_steps(list(plan.runs.values())))
    for run_dir in (plan.run_dir, *plan.runs.values()):
        check_output_dir(run_dir, overwrite=rl.overwrite, resume=resume, resumable=resumable)


def dry_run(rl: RLConfig, out: TextIO | None = None) -> None:
    """Resolve and write the per-process configs, check the orchestrators' environments (``dry_check``); print the
    commands ``rl`` would run (to stdout by default)."""
    out = out or sys.stdout
    plan = resolve_here(rl)
    with _locked(plan):  # a running launch's configs are not a dry run's to replace
        check_output_dirs(plan, rl)
        paths = write_configs(plan, dry_run=True)
    check_orchestrators(plan.specs)
    print(f"rl dry run: resolved configs written to {plan.run_dir.configs}", file=out)
    for name, path in paths.items():
        print(f"  {name:<{plan.name_width}}{path}  ({plan.devices.get(name, '')})", file=out)
    for name, run_dir in plan.runs.items():
        print(f"  run {name}: {run_dir.root}", file=out)
    for note in plan.notes:
        print(f"  note: {note}", file=out)
    if plan.resume_step is not None:
        print(f"  resuming from step {plan.resume_step}", file=out)
    urls = ", ".join([*plan.health_urls, *filter(None, [plan.teacher_health_url])])
    print(f"commands (in start order; the trainer starts once {urls} answers):", file=out)
    for spec in plan.specs:
        print(f"  {command_line(spec)}", file=out)


class _Unbreakable:
    """A console stream whose reader may go away while the run goes on (`rl ... | tee run.log` and tee killed at logout,
    the terminal gone under `nohup`): writes go nowhere once it broke. Before, the next line raised BrokenPipeError,
    which stopped every process of a healthy run with a traceback (exit 1)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.broken = False

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                self._break()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        # Python flushes sys.stdout at exit and would report the broken pipe again: its descriptor goes to /dev/null.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)


class _Console:
    """The live status line (redrawn in place on a terminal, one line per new step otherwise) and log echo."""

    def __init__(self, rl: RLConfig, plan: ResolvedRun, out: TextIO):
        self.mode = rl.console
        self.out = _Unbreakable(out)
        self.err = _Unbreakable(sys.stderr)
        self.tty = self.out.isatty()
        self.max_steps = rl.trainer.max_steps
        self.follower = MetricsFollower(plan.run_dir.metrics)
        self.run_followers = {name: MetricsFollower(run_dir.metrics) for name, run_dir in plan.runs.items()}
        self.start = time.monotonic()
        self._last_step: int | None = None
        self._drawn = False
        self._log_offsets: dict[str, int] = {}
        self._logs = {spec.name: spec.log_file for spec in plan.specs}

    def message(self, text: str) -> None:
        self.clear()
        print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        """The cause of a failed run: one line on stderr (the context, e.g. a log tail, goes to ``out``)."""
        self.clear()
        print(f"error: {text}", file=self.err, flush=True)

    def clear(self) -> None:
        if self._drawn:
            self.out.write("\r\033[K")
            self.out.flush()
            self._drawn = False

    def tick(self) -> None:
        if self.mode == "logs":
            self._echo_logs()
        if self.mode != "progress":
            return
        self.follower.poll()
        line = self.follower.line(self.max_steps, time.monotonic() - self.start)
        for name, follower in self.run_followers.items():
            follower.poll()
            line += f" | {format_run_line(name, follower)}"
        if self.tty:
            self.out.write("\r\033[K" + line[:200])
            self.out.flush()
            self._drawn = True
        else:
            step = self.follower.latest_step.get("trainer")
            if step is not None and step != self._last_step:
                self._last_step = step
                print(line, file=self.out, flush=True)

    def _echo_logs(self) -> None:
        for name, path in self._logs.items():
            offset = self._log_offsets.get(name, 0)
            try:
                with open_regular(path) as f:
                    if (
                        os.fstat(f.fileno()).st_size < offset
                    ):  # moved to .log.1 (`log_pump`): the new one from its start
                        offset = 0
                    f.seek(offset)
                    data = f.read(ECHO_BYTES)  # a child writing gigabytes is echoed a bounded part a tick
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                if len(data) == ECHO_BYTES:  # one line longer than that: echoed cut, not waited for
                    cut = len(data)
                else:
                    continue
            self._log_offsets[name] = offset + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                print(f"[{name}] {line}", file=self.out)
        self.out.flush()


def run(rl: RLConfig, out: TextIO | None = None) -> int:
    """Launch the run; return the exit code (0 after the trainer finished, 1 on failure, 128+signal). The output
    directories are locked before they are checked and until every process stopped (``prime_launch.run_lock``).

    A signal while no process runs (resolving, clearing or rewinding the directory before the start, the summary after
    the stop) ends the launch with one line too: before, Ctrl-C there was a ``KeyboardInterrupt`` traceback and
    SIGTERM ended ``rl`` without a word."""
    try:
        with _signals_raise():
            plan = resolve_here(rl)
            with _locked(plan) as locks:
                return _run(rl, plan, out, locks)
    except Interrupted as e:
        print(f"rl: received {e}; no process of the run is running", file=_Unbreakable(out or sys.stdout), flush=True)
        return 128 + e.signum


def _run(rl: RLConfig, plan: ResolvedRun, out: TextIO | None, locks: list[int] | None = None) -> int:
    plan, cleared = _prepare(rl, plan)
    console = _Console(rl, plan, out or sys.stdout)
    _announce(plan, cleared, console)
    run_id = next((s.env["PRIME_RUN_ID"] for s in plan.specs if "PRIME_RUN_ID" in s.env), None)
    manager = ProcessManager(
        grace_s=rl.stop_grace,
        liveness=RunWatchdog(plan, rl.liveness),
        hold_fds=locks or [],
        run_id=run_id,
        max_log_bytes=rl.max_log_mb << 20,
    )
    code, finished_ok = 0, False
    with _signals_raise() as restore, _on_continue(manager.liveness.resumed):
        try:
            _start(plan, rl, manager, console)
            finished_ok = _wait_for_trainer(plan, manager, console)
        except ProcessFailed as e:
            if tail := e.log_tail():
                console.message(tail)
            note = full_disk_note(plan.run_dir.root)  # a child that died of it could not log why
            console.error(f"{note}; {e.cause}" if note else e.cause)
            code = 1
        except StartupFailed as e:
            failed = "teacher" if plan.teacher_health_url and plan.teacher_health_url in str(e) else "inference"
            if failed in manager.procs:
                log = plan.run_dir.log_file(failed)
                console.message("\n".join([f"---- last lines of {log} ----", *tail_lines(log, 30), "----"]))
            console.error(str(e))
            code = 1
        except Interrupted as e:
            console.message(f"rl: received {e}; stopping every process")
            code = 128 + e.signum
        finally:
            restore(ignore=True)
            took = manager.stop_all()
            manager.close()
            restore(ignore=False)
            if code != 0 or not finished_ok:
                console.message(f"rl: stopped every process in {took:.1f} s")
    if finished_ok and code == 0:
        code = _check_final_weights(plan, console)
    _report(plan, console, finished_ok and code == 0)
    return code


def _check_final_weights(plan: ResolvedRun, console: _Console) -> int:
    """1 (and one line naming the file) when a run's final weights are not what the trainer wrote: nothing may have
    loaded them since (the last step's weights are published after the last rollouts), and the run is what a user
    takes away. Reads them once (docs/trainer.md has the cost)."""
    for run_dir in (*plan.runs.values(),) or (plan.run_dir,):
        latest = run_dir.latest_stable_weight_step()
        if latest is None:
            continue
        try:
            verify_weights(run_dir.weight_step(latest), latest)
        except ChangedWeights as e:
            console.error(f"the final weights are broken: {e}")
            return 1
    return 0


@contextmanager
def _locked(plan: ResolvedRun) -> Iterator[list[int]]:
    """Hold the lock of the run's output directory and of each run's under ``[[runs]]``; yields the locks' descriptors
    (the process manager's watchdog holds them too, until the processes it stops after a ``kill -9`` of rl are gone)."""
    with ExitStack() as held:
        fds = []
        for root in dict.fromkeys(d.root for d in (plan.run_dir, *plan.runs.values())):
            if (lock := lock_output_dir(root)) is not None:
                held.callback(lock.close)
                fds.append(lock.fileno())
        yield fds


def _prepare(rl: RLConfig, plan: ResolvedRun | None = None) -> tuple[ResolvedRun, list[RunDir]]:
    """Resolve the run (unless ``plan`` is given), check its directories and port, clear leftovers (returned: those of
    a failed start), write the configs."""
    plan = plan or resolve_here(rl)
    check_output_dirs(plan, rl)
    check_port_free(plan.configs.get("inference"), plan.configs.get("teacher"))
    resume = rl.resume or plan.resume_step is not None
    # What a start that failed before its first step left behind (configs, logs, step-0 rollouts) must not
    # block the directory, nor leak into this run.
    failed_starts = [d for d in (plan.run_dir, *plan.runs.values()) if not resume and existing_artifacts(d)]
    for run_dir in (plan.run_dir, *plan.runs.values()) if rl.overwrite else failed_starts:
        clear_run(run_dir)
    write_configs(plan, dry_run=False)
    return plan, [] if rl.overwrite else failed_starts


def _announce(plan: ResolvedRun, cleared: list[RunDir], console: _Console) -> None:
    console.message(f"rl: run directory {plan.run_dir.root}")
    for run_dir in cleared:
        console.message(f"rl: cleared the leftovers of a start that failed before its first step in {run_dir.root}")
    for spec in plan.specs:
        console.message(f"rl: {spec.name:<{plan.name_width}}{plan.devices.get(spec.name, '')}  log {spec.log_file}")
    for note in plan.notes:
        console.message(f"rl: {note}")
    if plan.resume_step is not None:
        console.message(f"rl: resuming from step {plan.resume_step}")
        for note in filter(None, (rewind(d, plan.resume_step) for d in (plan.run_dir, *plan.runs.values()))):
            console.message(f"rl: {note}")


@contextmanager
def _signals_raise() -> Iterator[Callable[..., None]]:
    """SIGINT, SIGTERM and SIGHUP (unless ignored at the start) raise ``Interrupted`` inside the block;
    ``restore(ignore=True)`` ignores them while the processes are stopped, ``restore(ignore=False)`` puts the previous
    handlers back."""

    def on_signal(signum, frame):
        # The first signal stops the run; more (Ctrl-C pressed twice, SIGTERM after SIGINT) wait until every process
        # stopped: before, a second one raised inside the handling of the first and cut its message off.
        restore(ignore=True)
        raise Interrupted(signum)

    # SIGHUP and SIGINT ignored when rl started (`nohup rl ...`, a background job of a script) stay ignored: a run left
    # to go on after its terminal closed was stopped by the hang-up it had asked to ignore (exit 129). SIGTERM, how a
    # scheduler or a user stops a run, always stops it.
    handled = [s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN] + [signal.SIGTERM]
    previous = {s: signal.signal(s, on_signal) for s in handled}

    def later(signum, frame):  # not SIG_IGN: Python reports a signal already caught but then ignored as an error
        pass

    def restore(*, ignore: bool) -> None:
        for s in handled:
            signal.signal(s, later if ignore else previous[s])

    try:
        yield restore
    finally:
        restore(ignore=False)


@contextmanager
def _on_continue(resumed: Callable[[], None]) -> Iterator[None]:
    """``resumed()`` on SIGCONT: `rl` stopped (Ctrl-Z) and continued, while its children, in their own sessions, ran
    on; its watchdog must not take its own sleep for their silence."""
    previous = signal.signal(signal.SIGCONT, lambda signum, frame: resumed())
    try:
        yield
    finally:
        signal.signal(signal.SIGCONT, previous)


def _start(plan: ResolvedRun, rl: RLConfig, manager: ProcessManager, console: _Console) -> None:
    """Inference and the orchestrators (which start their env servers while inference starts, and send nothing
    until /health answers with this run's id), then, once it is healthy, the trainer (on a shared GPU vLLM must
    reserve its memory first). With a server started elsewhere: check it, reset it to the base weights, start all."""
    specs = {spec.name: spec for spec in plan.specs}
    append = rl.resume or plan.resume_step is not None
    if rl.orchestrator.transport.type == "zmq":  # before any process reads it: an earlier launch's ones are refused
        new_transport_secret(plan.run_dir)
    own = "inference" in specs
    # The teacher loads while the rest starts (the orchestrators wait for it themselves too), unless it shares a GPU.
    if "teacher" in specs and not (own and plan.teacher_after_inference):
        manager.start(specs["teacher"], append_log=append)
    if own:
        for name in ("inference", *plan.orchestrators):
            manager.start(specs[name], append_log=append)
        urls = ", ".join(plan.health_urls)
        console.message(f"rl: started {', '.join(plan.orchestrators)}; waiting for inference at {urls}")
    else:
        console.message(f"rl: using the inference server at {', '.join(plan.health_urls)}")
    run_id = specs["inference"].env["PRIME_RUN_ID"] if own else None
    answers = wait_healthy(plan.health_urls, plan.api_key, rl.health_timeout, manager.poll, run_id, console.message)
    if own:
        console.message("rl: inference is healthy; starting trainer")
    else:
        check_served_model(answers, rl.orchestrator.model.name)
        if plan.resume_step in (None, 0):
            for message in reset_to_base(answers, plan.api_key, rl.health_timeout):
                console.message(f"rl: {message}")
        console.message(f"rl: starting {', '.join(plan.orchestrators)} and trainer")
        for name in plan.orchestrators:
            manager.start(specs[name], append_log=append)
    manager.liveness.probe(plan.health_urls, plan.api_key, server="inference" if own else None)
    if plan.teacher_health_url is not None:
        _start_teacher(plan, rl, manager, console, append)
    manager.start(specs["trainer"], append_log=append)


def _start_teacher(plan: ResolvedRun, rl: RLConfig, manager: ProcessManager, console: _Console, append: bool) -> None:
    """Start the teacher unless it already loads (it waited for the policy's server to hold its share of a GPU), wait
    for its /health with the same foreign-server check as the policy's, and probe it from then on."""
    spec = next(spec for spec in plan.specs if spec.name == "teacher")
    if spec.name not in manager.procs:
        manager.start(spec, append_log=append)
    assert plan.teacher_health_url is not None
    run_id = spec.env["PRIME_RUN_ID"]
    wait_healthy([plan.teacher_health_url], None, rl.health_timeout, manager.poll, run_id, console.message)
    console.message("rl: teacher is healthy")
    manager.liveness.probe([plan.teacher_health_url], None, server="teacher")


def _wait_for_trainer(plan: ResolvedRun, manager: ProcessManager, console: _Console) -> bool:
    """Until the trainer and every orchestrator finished (an orchestrator outlives the trainer when it evaluates
    the final weights); ``ProcessFailed`` when any process fails."""
    expected = {name: True for name in ("trainer", *plan.orchestrators)}
    finished_ok, last = False, "trainer"
    while not set(expected) <= set(manager.finished):
        done = manager.poll(expected)
        last = done or last
        if done == "trainer":
            finished_ok = True
            if not set(plan.orchestrators) <= set(manager.finished):
                console.message(f"rl: trainer finished; waiting for {_after_trainer(plan)}")
        elif done is not None and "trainer" not in manager.finished:
            console.message(f"rl: {done} finished its rollouts; waiting for the trainer")
        console.tick()
        time.sleep(POLL_S)
    console.tick()
    # The last to finish: after `trainer finished; waiting for the final evaluation`, a second `trainer finished`.
    console.message(f"rl: {last} finished; stopping the other processes")
    return finished_ok


def _after_trainer(plan: ResolvedRun) -> str:
    """What an orchestrator still does once the trainer finished: the final evaluation only where one is configured
    (``eval.envs``); else it is writing its last records."""
    evaluates = any(getattr(plan.configs.get(name), "eval", None) and plan.configs[name].eval.envs
                    for name in plan.orchestrators)  # fmt: skip
    return "the final evaluation" if evaluates else "the orchestrator to finish"


def _report(plan: ResolvedRun, console: _Console, succeeded: bool) -> None:
    """Each run's summary (a multi-tenant trainer logs each run's losses to the run's own metrics.jsonl) and, after
    a normal finish, where the final weights are."""
    results = {f"run {name}": run_dir for name, run_dir in plan.runs.items()} or {"": plan.run_dir}
    for label, run_dir in results.items():
        try:
            summary = summarize(run_dir.metrics)
        except UnreadableFile as e:  # a FIFO or a file of gigabytes at metrics.jsonl: the run's outcome stands
            console.message(f"rl: no summary: {e}")
            continue
        if summary["trainer_steps"] or summary["rollout_steps"]:
            console.message(format_summary(summary, title=label))
    if succeeded:
        for label, run_dir in results.items():
            latest = run_dir.latest_stable_weight_step()
            if latest is not None:
                prefix = f"{label} " if label else ""
                console.message(f"rl: {prefix}final weights {run_dir.weight_step(latest)}")
        console.message("rl: done")
    elif steps := plan.run_dir.resumable_steps(list(plan.runs.values())):
        # A stopped or failed run said nothing of what it could continue from (`prime-launch rewind` and --resume).
        console.message(f"rl: the newest checkpoint is step {steps[-1]}: the same command with --resume continues it")
