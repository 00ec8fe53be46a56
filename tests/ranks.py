"""Teardown of the process groups that multi-rank tests start themselves (``mp.spawn`` workers)."""

from __future__ import annotations

import sys

import torch.distributed as dist
from prime_trainer.entrypoints import exit_without_finalizing


def leave_group() -> None:
    """Destroy this rank's process group; call it from the worker's ``finally``. After a clean run the ranks first
    meet at a barrier: a rank that tore its gloo pairs down while a peer was still finishing its last collective
    aborted with SIGABRT under CI load. While an exception propagates nobody waits, since the peers may never come.
    A clean rank then ends without Python's finalization, as the trainer's ranks do (its docstring says why); the
    worker's return value is not used by ``mp.spawn``."""
    clean = sys.exc_info()[0] is None
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    if clean:
        exit_without_finalizing()
