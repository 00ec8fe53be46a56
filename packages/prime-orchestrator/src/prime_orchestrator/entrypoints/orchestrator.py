"""``orchestrator`` entry point: parse the config first, import the rest after."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> None:
    import asyncio
    import json

    from prime_core.config import write_config
    from prime_core.early_sigint import ends_on_sigint
    from prime_core.progress import stop_reporting

    with ends_on_sigint("orchestrator: interrupted (SIGINT) while starting, before its first step"):
        config, orchestrator = _prepare(argv)
    if config.bench:
        from prime_orchestrator.bench import run_bench

        print(json.dumps(asyncio.run(run_bench(orchestrator)), indent=2))
        return
    write_config(config, orchestrator.run_dir.config_file("orchestrator"))
    run(orchestrator, config.output_dir)
    stop_reporting()


def _prepare(argv: list[str] | None) -> tuple[Any, Any]:
    """The config (parsed, its environments and judge checked) and the `Orchestrator`, with logging set up."""
    from prime_core.config import parse_cli
    from prime_core.config.orchestrator import OrchestratorConfig

    config = parse_cli(
        OrchestratorConfig,
        argv,
        prog="orchestrator",
        description="Rollouts, advantages, packing and weight relay for RL (see docs/orchestrator.md).",
        on_dry_run=dry_run,
        writes_output_dir=True,
    )

    from prime_core.progress import start_reporting

    if not config.bench:
        start_reporting(config.output_dir, "orchestrator")
    from prime_core.logging import setup_logging
    from prime_core.run_dir import RunDir

    from prime_orchestrator.env_config import check_envs, check_training_envs
    from prime_orchestrator.orchestrator import Orchestrator

    check_envs({"env": config.env, "eval.envs": config.eval.envs})  # before the run waits on any server
    check_training_envs(config)
    run_dir = RunDir(config.output_dir)
    setup_logging(
        "orchestrator", level=config.log.level, log_file=run_dir.log_file("orchestrator") if config.log.file else None
    )
    return config, Orchestrator(config)


def dry_run(config: Any) -> None:
    """``--dry-run``: the environments' settings are checked too (what verifiers refuses is one line naming the key,
    exit 2; ``rl --dry-run`` runs this), then the resolved config is written as every entry point's dry run does."""
    from prime_core.config.cli import show_resolved

    from prime_orchestrator.env_config import check_envs, check_training_envs

    check_envs({"env": config.env, "eval.envs": config.eval.envs})
    check_training_envs(config)
    show_resolved(config, "orchestrator")


def run(orchestrator: Any, output_dir: Path) -> None:
    """Run the orchestrator; the faults of a run (not bugs here) end it with one line on stderr."""
    from prime_core.io import UnreadableFile, storage_error, storage_error_line
    from prime_core.monitor import MonitorUnavailable

    from prime_orchestrator.client import WeightUpdateError
    from prime_orchestrator.curriculum import CurriculumExhausted
    from prime_orchestrator.distill import TeacherError
    from prime_orchestrator.env_server import EnvServerFailed
    from prime_orchestrator.envs import TasksetError
    from prime_orchestrator.interrupt import Interrupts, run_noting_sigint
    from prime_orchestrator.judges import JudgeUnreachable
    from prime_orchestrator.liveness import RolloutsFailed
    from prime_orchestrator.weight_relay import ForeignWeights

    notes = Interrupts(orchestrator, output_dir)  # the progress record at the first SIGINT
    try:
        run_noting_sigint(orchestrator, notes)
    except JudgeUnreachable as e:
        sys.exit(f"orchestrator: {e}")
    except KeyboardInterrupt:  # before: exit 130 without a word
        notes.say()  # a second Ctrl-C from here on ends at once (``Interrupts.end_now``)
        sys.exit(130)
    except (TasksetError, ForeignWeights) as e:  # bad input, like a config error
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (
        RolloutsFailed,
        WeightUpdateError,
        TimeoutError,
        TeacherError,
        CurriculumExhausted,
        UnreadableFile,
        MonitorUnavailable,
        EnvServerFailed,
    ) as e:
        # A fault of the run, not a bug here: one line (rl repeats it as the run's cause).
        print(f"error: {e}".splitlines()[0], file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        if (found := storage_error(e)) is None:
            raise
        print(f"error: {storage_error_line(found, output_dir)}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
