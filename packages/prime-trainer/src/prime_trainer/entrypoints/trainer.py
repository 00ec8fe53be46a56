"""``trainer``: the RL trainer. Run it directly (one process) or under torchrun (several processes and nodes).

trainer @ train.toml
torchrun --nproc-per-node 8 -m prime_trainer.entrypoints.trainer @ train.toml
trainer --bench --model.name <dir> --data.fake.batch-size 8
"""

from __future__ import annotations

from prime_core.early_sigint import ends_on_sigint


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C while parsing or importing torch: one line, not a traceback from inside an import.
    with ends_on_sigint("trainer: interrupted (SIGINT) while starting, before its first step"):
        from prime_core.config import parse_cli
        from prime_core.config.trainer import TrainerConfig

        from prime_trainer.entrypoints import run_training

        config = parse_cli(TrainerConfig, argv, prog="trainer", description=__doc__, writes_output_dir=True)
        if not config.bench:
            import os

            from prime_core.progress import start_reporting

            start_reporting(config.output_dir, "trainer", rank=int(os.environ.get("RANK", "0")))
        if config.runs:  # several LoRA runs on one base
            from prime_trainer.rl.multi_run import train_runs as train
        else:
            from prime_trainer.rl.train import train

    run_training(train, config)


if __name__ == "__main__":
    main()
