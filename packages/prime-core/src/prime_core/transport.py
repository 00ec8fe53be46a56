"""How micro-batches travel from the orchestrator to trainer ranks.

``filesystem`` (default): ``rollouts/step_N/rank_R.safetensors`` in the shared output directory.
``zmq``: the orchestrator pushes the same bytes to each trainer rank over ZMQ (multi-host without shared
storage). Both sides go through ``make_sender`` / ``make_receiver`` so the trainer and orchestrator never
know which transport is configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

from pydantic import Field

from prime_core.config.base import BaseConfig
from prime_core.io import wait_for_path, writing
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta, read_microbatches, write_microbatches


class RolloutTransportConfig(BaseConfig):
    """Rollout transport between orchestrator and trainer."""

    type: Literal["filesystem", "zmq"] = "filesystem"
    """filesystem: files in the shared output dir; zmq: pushed over the network to each trainer rank."""
    host: str = "127.0.0.1"
    """zmq: host of trainer rank 0's node; rank r listens on port base_port + r."""
    base_port: int = Field(default=29600, ge=1024, le=65000)
    """zmq: first port; trainer rank r binds base_port + r."""


class RolloutSender(Protocol):
    def send(self, step: int, rank: int, meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> None: ...

    def close(self) -> None: ...


class RolloutReceiver(Protocol):
    def receive(self, step: int, *, timeout: float | None) -> tuple[RolloutBatchMeta, list[MicroBatch]]: ...

    def close(self) -> None: ...


class FilesystemSender:
    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def send(self, step: int, rank: int, meta: RolloutBatchMeta, micro_batches: list[MicroBatch]) -> None:
        path = self.run_dir.rollout_file(step, rank)
        with writing(f"rollouts of step {step} for trainer rank {rank}", path):
            write_microbatches(path, meta, micro_batches)

    def close(self) -> None:
        pass


class FilesystemReceiver:
    def __init__(self, run_dir: RunDir, rank: int, on_wait=None):
        self.run_dir = run_dir
        self.rank = rank
        self.on_wait = on_wait

    def path(self, step: int) -> Path:
        return self.run_dir.rollout_file(step, self.rank)

    def receive(self, step: int, *, timeout: float | None) -> tuple[RolloutBatchMeta, list[MicroBatch]]:
        path = wait_for_path(self.path(step), timeout=timeout, on_wait=self.on_wait)
        return read_microbatches(path)

    def close(self) -> None:
        pass


def make_sender(config: RolloutTransportConfig, run_dir: RunDir, num_ranks: int) -> RolloutSender:
    if config.type == "filesystem":
        return FilesystemSender(run_dir)
    from prime_core.transport_zmq import ZmqSender

    return ZmqSender(config, num_ranks)


def make_receiver(config: RolloutTransportConfig, run_dir: RunDir, rank: int, on_wait=None) -> RolloutReceiver:
    if config.type == "filesystem":
        return FilesystemReceiver(run_dir, rank, on_wait=on_wait)
    from prime_core.transport_zmq import ZmqReceiver

    return ZmqReceiver(config, rank, on_wait=on_wait)
