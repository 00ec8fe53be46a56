"""``rl``: run inference, orchestrator and trainer together on this node."""

from __future__ import annotations

import sys

DESCRIPTION = """Start inference (unless no [inference] config is given: then the server at
--orchestrator.client.base-urls is used), wait for its /health, then start orchestrator and trainer. Each
process gets its resolved config at <output-dir>/configs/<process>.toml and logs to
<output-dir>/logs/<process>.log. If any process fails, or on Ctrl-C, every process is stopped.
With [[runs]] (multi-tenant LoRA) one trainer trains an adapter per run and each run gets an orchestrator
(orchestrator-<name>) writing to its own directory.
Examples:
  rl @ examples/reverse_text/rl.toml
  rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml --output-dir outputs1
  rl @ rl.toml --dry-run"""


def main(argv: list[str] | None = None) -> int:
    from prime_core.config import parse_cli
    from prime_core.config.rl import RLConfig

    def on_dry_run(config: RLConfig) -> None:
        from prime_launch.launcher import dry_run

        try:
            dry_run(config)
        except (ValueError, FileExistsError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:  # the checks it started are killed on the way out (dry_check)
            print("rl: dry run interrupted; nothing was started", file=sys.stderr)
            raise SystemExit(130) from None

    config = parse_cli(
        RLConfig, argv, prog="rl", description=DESCRIPTION, on_dry_run=on_dry_run, writes_output_dir=True
    )
    from prime_launch.launcher import run

    try:
        return run(config)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
