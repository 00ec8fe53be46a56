"""``eval`` entry point: score a model and its checkpoints on environments."""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str] | None = None) -> None:
    from prime_core.early_sigint import ends_on_sigint

    # Ctrl-C while parsing or importing verifiers: one line, not a traceback from inside an import.
    with ends_on_sigint("eval: interrupted (SIGINT) while starting, before any rollout"):
        from prime_core.config import parse_cli
        from prime_core.config.orchestrator import EvalConfig

        config = parse_cli(
            EvalConfig,
            argv,
            prog="eval",
            description="Evaluate a served model (and checkpoints under --weights-dir) on environments.",
            on_dry_run=dry_run,
            writes_output_dir=True,
        )
        _check_output_dir(config)  # first: a file read, where the environments' check imports verifiers (seconds)
        _check_env_settings(config)
        import asyncio

        from prime_core.logging import setup_logging

        from prime_orchestrator.client import ServerUnreachable, WeightUpdateError
        from prime_orchestrator.env_server import EnvServerFailed
        from prime_orchestrator.envs import TasksetError
        from prime_orchestrator.eval_runner import run_eval
        from prime_orchestrator.judges import JudgeUnreachable
        from prime_orchestrator.liveness import RolloutsFailed

    setup_logging("eval", level=config.log.level)
    try:
        asyncio.run(run_eval(config))
    except ServerUnreachable as e:
        sys.exit(f"eval: {e}; start one (inference ...) or pass --client.base-url")
    except JudgeUnreachable as e:
        sys.exit(f"eval: {e}")
    except TasksetError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (RolloutsFailed, EnvServerFailed, WeightUpdateError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:  # before: exit 130 without a word
        print(f"eval: interrupted (SIGINT); weights scored in full before it: {_scored(config)}", flush=True)
        sys.exit(130)
    except Exception as e:
        # A full disk under the results: one line naming errno and file instead of a traceback.
        from prime_core.io import storage_error, storage_error_line

        if (found := storage_error(e)) is None:
            raise
        print(f"error: {storage_error_line(found, config.output_dir)}", file=sys.stderr, flush=True)
        sys.exit(1)


def _scored(config: Any) -> str:
    """The labels ``eval/results.json`` holds (written also when the eval stops), and where."""
    import json
    from pathlib import Path

    path = Path(config.output_dir) / "eval" / "results.json"
    try:
        labels = list(json.loads(path.read_text()))
    except (OSError, ValueError):
        return "none"
    return f"{', '.join(labels)} ({path})" if labels else "none"


def _check_env_settings(config: Any) -> None:
    """The environments' settings as verifiers validates them: one line naming the key, exit 2."""
    from prime_orchestrator.env_config import check_envs

    check_envs({"env" if config.env else "environment_ids": config.resolved_envs()})


def _check_output_dir(config: Any) -> None:
    """Results of other weights under the labels this eval writes: one line, exit 2, before anything runs."""
    from prime_core.config import ConfigError
    from prime_core.config.cli import fail

    from prime_orchestrator.eval_runner import check_output_dir

    try:
        check_output_dir(config)
    except ConfigError as e:
        fail(str(e))


def dry_run(config: Any) -> None:
    """``--dry-run`` checks the environments' settings too, then writes the resolved config."""
    from prime_core.config.cli import show_resolved

    _check_env_settings(config)
    show_resolved(config, "eval")


if __name__ == "__main__":
    main()
