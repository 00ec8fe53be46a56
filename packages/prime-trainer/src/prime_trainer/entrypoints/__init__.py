"""Console entry points (``trainer``, ``sft``): parse the config before importing torch, then train."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any


def run_training(train: Callable[[Any], None], config: Any) -> None:
    """Run ``train(config)`` with the errors a user can act on reported as one line instead of a traceback."""
    from prime_core.config import ConfigError
    from prime_core.config.cli import fail
    from prime_core.io import UnreadableFile
    from prime_core.monitor import MonitorUnavailable
    from prime_core.progress import stop_reporting

    from prime_trainer.optim import NonFiniteGradients
    from prime_trainer.world import shutdown_world

    finished = False
    try:
        train(config)
        finished = True
        stop_reporting()  # the watchdog now expects this rank to exit
    except ConfigError as e:
        # Settings that only the world (ranks, data) shows to be wrong: one line, like a parse error.
        fail(str(e))
    except (NonFiniteGradients, UnreadableFile, MonitorUnavailable) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C of a trainer on its own: before, a traceback from wherever the step was
        print(interrupted_line(config), file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as e:
        # A full disk (checkpoint, weights, logs): one line naming errno and path instead of a traceback.
        from prime_core.io import storage_error, storage_error_line

        if (found := storage_error(e)) is None:
            raise
        print(f"error: {storage_error_line(found, config.output_dir)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        shutdown_world(wait_for_peers=finished)
    if finished:
        exit_without_finalizing()


def interrupted_line(config: Any) -> str:
    """What a trainer stopped by Ctrl-C says: where the run can resume from (its newest complete checkpoint)."""
    from prime_core.config.trainer import SFTConfig
    from prime_core.run_dir import RunDir

    prog = "sft" if isinstance(config, SFTConfig) else "trainer"
    steps = RunDir(config.output_dir).checkpoint_steps()
    if steps:
        resume = f"; resume from its newest checkpoint with --ckpt.resume-step {steps[-1]}"
    else:
        resume = "; it saved no checkpoint to resume from" + (
            " (ckpt.interval is unset)" if config.ckpt.interval is None else ""
        )
    return f"{prog}: interrupted (SIGINT){resume}"


def exit_without_finalizing() -> None:
    """End a rank that finished cleanly without Python's finalization. On several ranks, finalization frees the
    process groups that DTensors still hold; gloo's worker threads, still releasing tensors, then take the GIL after
    finalization has begun and the rank aborts (SIGABRT, "terminate called without an active exception"): about one
    CI run in two. On one rank it only costs time: tearing down torch's modules and tensors took 2 s on 2 cores, and
    `rl` waits for the trainer's exit before it stops the rest. Everything the run writes is closed by then
    (checkpoints, weights, metrics, W&B)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
