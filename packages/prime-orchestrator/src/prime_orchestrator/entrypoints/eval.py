"""``eval`` entry point: score a model and its checkpoints on environments."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from prime_core.config import parse_cli
    from prime_core.config.orchestrator import EvalConfig

    config = parse_cli(
        EvalConfig,
        argv,
        prog="eval",
        description="Evaluate a served model (and checkpoints under --weights-dir) on environments.",
    )

    import asyncio

    from prime_core.logging import setup_logging

    from prime_orchestrator.eval_runner import run_eval

    setup_logging("eval", level=config.log.level)
    asyncio.run(run_eval(config))


if __name__ == "__main__":
    main()
