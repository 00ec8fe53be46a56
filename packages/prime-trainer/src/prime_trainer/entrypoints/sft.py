"""``sft``: supervised fine-tuning on chat data. Run it directly (one process) or under torchrun.

sft @ sft.toml
torchrun --nproc-per-node 8 -m prime_trainer.entrypoints.sft @ sft.toml
sft --bench --model.name <dir>
"""

from __future__ import annotations

from prime_core.config import parse_cli
from prime_core.config.trainer import SFTConfig

from prime_trainer.entrypoints import run_training


def main(argv: list[str] | None = None) -> None:
    config = parse_cli(SFTConfig, argv, prog="sft", description=__doc__, writes_output_dir=True)
    from prime_trainer.sft.train import train

    run_training(train, config)


if __name__ == "__main__":
    main()
