"""``sft``: supervised fine-tuning on chat data. Run it directly (one process) or under torchrun.

sft @ sft.toml
torchrun --nproc-per-node 8 -m prime_trainer.entrypoints.sft @ sft.toml
sft --bench --model.name <dir>
"""

from __future__ import annotations

import sys

from prime_core.config import ConfigError, parse_cli
from prime_core.config.cli import fail
from prime_core.config.trainer import SFTConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(SFTConfig, argv, prog="sft", description=__doc__)
    from prime_trainer.sft.train import train
    from prime_trainer.world import shutdown_world

    try:
        train(config)
    except ConfigError as e:
        # Settings that only the world (ranks, data) shows to be wrong: one line, like a parse error.
        fail(str(e))
    except Exception as e:
        # A full disk (checkpoint, weights, logs): one line naming errno and path instead of a traceback.
        from prime_core.io import storage_error, storage_error_line

        if (found := storage_error(e)) is None:
            raise
        print(f"error: {storage_error_line(found, config.output_dir)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        shutdown_world()


if __name__ == "__main__":
    main()
