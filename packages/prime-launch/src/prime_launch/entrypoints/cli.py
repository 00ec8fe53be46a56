"""``prime-launch``: SLURM jobs (``slurm rl`` / ``slurm sft``) and run reports (``report``)."""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage: prime-launch <command> ...

commands:
  slurm rl  @ rl.toml  [--slurm.KEY VALUE ...] [--dry-run]   render (and sbatch) an RL job
  slurm sft @ sft.toml [--slurm.KEY VALUE ...] [--dry-run]   render (and sbatch) an SFT job
  report [--output-dir DIR] [--out PNG]                      plot reward and loss curves (alias: plot)
  watch --output-dir DIR [--trainer-ranks N] [--health-urls URL,...]
  watch @ rl.toml [rl flags] [--trainer-ranks N] ...         the watchdog beside a job's processes (exit 1: stuck;
                                                             a run that already ended: one line, 0 finished, 1 not);
                                                             an rl config (and flags) names the run directory
  rewind --output-dir DIR --step N                           before a resume: drop the stopped run's later steps
  log-to FILE [--max-mb N] [--append]                        standard input into FILE, moved to FILE.1 past N MiB
                                                             (a multi-node job's process logs)

`prime-launch <command> --help` lists every option of a command.
"""


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def slurm_config_model(kind: str) -> type:
    """The config of ``prime-launch slurm <kind>``: the rl or sft config plus a ``[slurm]`` section."""
    from prime_core.config.slurm import SlurmConfig
    from pydantic import Field, create_model

    if kind == "rl":
        from prime_core.config.rl import RLConfig as Base

        extra = {}
    else:
        from prime_core.config.rl import RLConfig
        from prime_core.config.trainer import SFTConfig as Base

        # The job's log (logs/sft.log) is bounded as rl's logs are, by the same knob (its docstring).
        doc = RLConfig.model_fields["max_log_mb"].description
        extra = {"max_log_mb": (int, Field(default=1024, ge=1, le=1 << 20, description=doc))}
    return create_model(
        f"Slurm{Base.__name__}",
        __base__=Base,
        __doc__=f"A SLURM job running {kind}: the {kind} config plus a [slurm] section.",
        slurm=(SlurmConfig, Field(default_factory=SlurmConfig, description="SLURM job settings.")),
        **extra,
    )


def _slurm(kind: str, argv: list[str]) -> int:
    from prime_core.config import parse_cli

    model = slurm_config_model(kind)
    from prime_launch import slurm_jobs

    config = parse_cli(
        model,
        argv,
        prog=f"prime-launch slurm {kind}",
        description=f"Render the sbatch script of a {kind} job from its template and submit it with sbatch "
        "(--dry-run: write and print the script only).",
        on_dry_run=lambda c: _run_slurm(slurm_jobs, kind, c, dry_run=True),
        network=False,  # the job downloads on its nodes, which may reach the hub where this host does not
    )
    return _run_slurm(slurm_jobs, kind, config, dry_run=False)


def _run_slurm(slurm_jobs, kind: str, config, *, dry_run: bool) -> int:
    try:
        job = slurm_jobs.prepare(kind, config, dry_run=dry_run)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        raise SystemExit(_fail(str(e))) from None
    if dry_run:
        print(job.script, end="")
        print(f"# dry run: script written to {job.script_path}; submit with: sbatch {job.script_path}", file=sys.stderr)
        return 0
    try:
        from prime_launch.slurm import submit

        job_id = submit(job.script_path)
    except RuntimeError as e:
        return _fail(str(e))
    print(f"submitted job {job_id} ({job.template}): {job.script_path}")
    print(f"  job log: {str(job.job_log).replace('%j', job_id)}")
    for log in job.process_logs:
        print(f"  log:     {log}")
    print(f"  follow:  tail -f {str(job.job_log).replace('%j', job_id)}    cancel: scancel {job_id}")
    return 0


def _report(argv: list[str]) -> int:
    from prime_core.config import BaseConfig, parse_cli

    class ReportConfig(BaseConfig):
        """Plot the reward, loss, mismatch KL and throughput curves of a run to a PNG."""

        output_dir: Path = Path("outputs")
        """Run directory holding metrics.jsonl."""
        out: Path | None = None
        """PNG path; default ``<output-dir>/report.png``."""
        title: str | None = None
        """Figure title; default the run directory."""

    config = parse_cli(ReportConfig, argv, prog="prime-launch report")
    if not config.output_dir.is_dir():  # before: `no metrics in <dir>/metrics.jsonl`, as for a run that logged none
        return _fail(f"output-dir: {str(config.output_dir)!r} is not a run directory (no such directory)")
    from prime_launch.report import plot_run

    out = config.out or config.output_dir / "report.png"
    try:
        path = plot_run(config.output_dir / "metrics.jsonl", out, title=config.title)
    except ValueError as e:
        return _fail(str(e))
    print(f"wrote {path}")
    return 0


def watch_run_model() -> type:
    """The config of ``prime-launch watch @ rl.toml``: the run's rl config (its flags too, so the run directory is the
    one ``rl`` with the same arguments uses) plus watch's own settings, less those the run gives: ``output_dir``,
    ``liveness`` (its ``[liveness]`` section) and ``orchestrator`` (a run's is always watched)."""
    from prime_core.config.liveness import WatchConfig
    from prime_core.config.rl import RLConfig
    from pydantic import create_model

    own = {name: (f.annotation, f) for name, f in WatchConfig.model_fields.items() if name not in RLConfig.model_fields}
    return create_model(
        "WatchRunConfig",
        __base__=RLConfig,
        __doc__="The watchdog beside the processes of the run of an rl config.",
        **own,
    )


def _watch_config(argv: list[str]):
    """`WatchConfig` from watch's own flags, or (an ``@ file`` among them) from an rl config (`watch_run_model`)."""
    from prime_core.config import config_to_toml, parse_cli
    from prime_core.config.liveness import WatchConfig

    if not any(token.startswith("@") for token in argv):
        return parse_cli(WatchConfig, argv, prog="prime-launch watch")

    def of_run(c) -> WatchConfig:
        own = {name: getattr(c, name) for name in ("trainer_ranks", "health_urls", "api_key_var")}
        return WatchConfig(output_dir=c.run_dir, liveness=c.liveness, **own)

    def show(c) -> None:
        sys.stdout.write(config_to_toml(of_run(c)))

    description = "The watchdog beside the processes of the run an rl config names (--dry-run prints what it watches)."
    model = watch_run_model()
    return of_run(parse_cli(model, argv, prog="prime-launch watch", description=description, on_dry_run=show))


def _watch(argv: list[str]) -> int:
    config = _watch_config(argv)
    from prime_launch.watchdog import ProcessStuck, RunEnded, watch_forever

    try:
        watch_forever(config)
    except ProcessStuck as e:
        return _fail_run(e.cause)
    except RunEnded as e:
        if e.code:
            return _fail_run(e.line)
        print(e.line, flush=True)  # a finished run is no error: one line on stdout
    return 0


def _fail_run(cause: str) -> int:
    print(f"error: {cause}", file=sys.stderr, flush=True)
    return 1


def _rewind(argv: list[str]) -> int:
    from prime_core.config import BaseConfig, parse_cli
    from pydantic import Field

    class RewindConfig(BaseConfig):
        """Before resuming a stopped run at ``step``: remove its rollouts of steps >= step and weights after it."""

        output_dir: Path = Path("outputs")
        """The run directory."""
        step: int = Field(ge=0)
        """The checkpoint step the run resumes from."""

    config = parse_cli(RewindConfig, argv, prog="prime-launch rewind")
    if not config.output_dir.is_dir():
        return _fail(f"output-dir: {str(config.output_dir)!r} is not a run directory (no such directory)")
    from prime_core.run_dir import RunDir

    from prime_launch.resume import rewind

    run_dir = RunDir(config.output_dir)
    if config.step not in (steps := run_dir.checkpoint_steps()):
        # Weights after the step go: a typo would leave every later checkpoint without the weights it resumes with.
        have = ", ".join(map(str, steps)) or "none"
        return _fail(f"step: {config.step} is not a complete checkpoint of {run_dir.root} (complete checkpoint steps: "
                     f"{have}); rewind to the step the run resumes from")  # fmt: skip
    from prime_core.io import UnreadableFile

    from prime_launch.run_end import running
    from prime_launch.run_lock import lock_output_dir

    # Before, a running run's rollouts, weights and the checkpoint being written went, and its trainer died.
    try:
        lock = lock_output_dir(run_dir.root)  # held by a running `rl`
    except FileExistsError as e:
        return _fail(f"{e}; rewind only a stopped run")
    try:
        if live := running(run_dir):
            return _fail(f"output-dir: {', '.join(live)} of the run in {run_dir.root} still running; rewind only a "
                         "stopped run")  # fmt: skip
        print(rewind(run_dir, config.step) or f"nothing after step {config.step} to remove")
    except UnreadableFile as e:  # a metrics.jsonl it cannot set the redone steps' records aside from
        return _fail(str(e))
    finally:
        if lock is not None:
            lock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _fail("prime-launch needs a command: slurm, report, watch, rewind or log-to (--help lists them)")
    if argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "slurm":
        if not rest or rest[0] not in ("rl", "sft"):
            if rest and rest[0] in ("-h", "--help"):
                sys.stdout.write(USAGE)
                return 0
            return _fail(
                "prime-launch slurm needs the job kind first: `prime-launch slurm rl ...` or `... slurm sft ...`"
            )
        return _slurm(rest[0], rest[1:])
    if command in ("report", "plot"):
        return _report(rest)
    if command == "watch":
        return _watch(rest)
    if command == "rewind":
        return _rewind(rest)
    if command == "log-to":
        return _log_to(rest)
    return _fail(f"unknown command {command!r} (slurm, report, watch, rewind, log-to)")


def _log_to(argv: list[str]) -> int:
    """What a multi-node job's process writes (its standard output, this one's input) into its log, bounded as `rl`
    bounds the logs of the processes it starts (``prime_launch.log_pump``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="prime-launch log-to", description=_log_to.__doc__)
    parser.add_argument("file", type=Path, help="the log file")
    parser.add_argument("--max-mb", type=int, default=1024, help="MiB after which FILE moves to FILE.1 (default 1024)")
    parser.add_argument("--append", action="store_true", help="append to FILE instead of starting it afresh")
    args = parser.parse_args(argv)
    if args.max_mb < 1:
        return _fail(f"max-mb: {args.max_mb} is not a positive number of MiB")
    from prime_launch.log_pump import LogPump

    try:
        pump = LogPump(sys.stdin.fileno(), args.file, args.max_mb << 20, append=args.append)
    except OSError as e:
        return _fail(f"file: cannot write {args.file}: {e.strerror or e}")
    pump.drain()  # until every writer of the input is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
