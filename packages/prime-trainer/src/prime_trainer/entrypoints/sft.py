"""``sft``: supervised fine-tuning on chat data. Run it directly (one process) or under torchrun.

sft @ sft.toml
torchrun --nproc-per-node 8 -m prime_trainer.entrypoints.sft @ sft.toml
sft --bench --model.name <dir>
"""

from __future__ import annotations

import os

from prime_core.early_sigint import ends_on_sigint


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C while parsing or importing torch: one line, not a traceback from inside an import.
    with ends_on_sigint("sft: interrupted (SIGINT) while starting, before its first step"):
        from prime_core.config import parse_cli
        from prime_core.config.trainer import SFTConfig

        from prime_trainer.entrypoints import run_training

        config = parse_cli(SFTConfig, argv, prog="sft", description=__doc__, writes_output_dir=True)
        if config.overwrite and os.environ.get("RANK", "0") == "0":  # before any rank writes (they meet in init_world)
            from prime_core.run_dir import RunDir, clear_run

            clear_run(RunDir(config.output_dir))
        from prime_trainer.sft.train import train

    run_training(train, config)


if __name__ == "__main__":
    main()
