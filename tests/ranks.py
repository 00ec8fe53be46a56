"""Teardown of the process groups that multi-rank tests start themselves (``mp.spawn`` workers)."""

from __future__ import annotations

import sys

import torch.distributed as dist


def leave_group() -> None:
    """Destroy this rank's process group; call it from the worker's ``finally``. After a clean run the ranks first
    meet at a barrier: a rank that tore its gloo pairs down while a peer was still finishing its last collective
    aborted with SIGABRT under CI load. While an exception propagates nobody waits, since the peers may never come."""
    if sys.exc_info()[0] is None:
        dist.barrier()
    dist.destroy_process_group()
