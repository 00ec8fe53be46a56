"""``orchestrator`` entry point: parse the config first, import the rest after."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from prime_core.config import parse_cli
    from prime_core.config.orchestrator import OrchestratorConfig

    config = parse_cli(
        OrchestratorConfig,
        argv,
        prog="orchestrator",
        description="Rollouts, advantages, packing and weight relay for RL (see docs/orchestrator.md).",
    )

    import asyncio
    import json

    from prime_core.logging import setup_logging
    from prime_core.run_dir import RunDir

    from prime_orchestrator.judges import JudgeUnreachable
    from prime_orchestrator.orchestrator import Orchestrator

    run_dir = RunDir(config.output_dir)
    setup_logging(
        "orchestrator", level=config.log.level, log_file=run_dir.log_file("orchestrator") if config.log.file else None
    )
    orchestrator = Orchestrator(config)
    if config.bench:
        print(json.dumps(asyncio.run(orchestrator.bench()), indent=2))
        return
    from prime_core.config import write_config

    write_config(config, run_dir.config_file("orchestrator"))
    try:
        asyncio.run(orchestrator.run())
    except JudgeUnreachable as e:
        sys.exit(f"orchestrator: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
