"""How micro-batches travel from the orchestrator to trainer ranks.

``filesystem`` (default): ``rollouts/step_N/rank_R.safetensors`` in the shared output directory.
``zmq``: the orchestrator pushes the same bytes to each trainer rank over ZMQ (multi-host without shared
storage). Both sides go through ``make_sender`` / ``make_receiver`` so the trainer and orchestrator never
know which transport is configured.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Literal, Protocol

from pydantic import Field, field_validator

from prime_core.config.base import BaseConfig, ConfigError
from prime_core.io import ExposedFile, UnreadableFile, atomic_write_bytes, read_regular, wait_for_path, writing
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta, read_microbatches, write_microbatches


class RolloutTransportConfig(BaseConfig):
    """Rollout transport between orchestrator and trainer."""

    type: Literal["filesystem", "zmq"] = "filesystem"
    """filesystem: files in the shared output dir; zmq: pushed over the network to each trainer rank."""
    host: str = "127.0.0.1"
    """zmq (orchestrator): the trainer nodes' hosts, comma-separated in node order (a multi-node job sets them);
    the trainer ranks are split evenly over them, rank r listening on port base_port + r."""
    bind_host: str = "127.0.0.1"
    """zmq (trainer): the interface each rank binds. 127.0.0.1 keeps the transport on this machine; a multi-node job
    (``prime-launch slurm``) binds 0.0.0.0 so the orchestrator on another node can connect. Every message must carry
    this run's secret (``transport.secret`` in the output dir, or ``$PRIME_TRANSPORT_SECRET``) to be trained on."""
    base_port: int = Field(default=29600, ge=1024, le=65000)
    """zmq: first port; trainer rank r binds base_port + r."""
    max_message_mb: int = Field(default=4096, ge=1)
    """zmq: the largest batch (one rank's micro-batches of one step, MiB) a trainer rank accepts; a bigger message
    drops its sender's connection before it is read into memory, and the orchestrator refuses to send one."""

    @field_validator("host", "bind_host")
    @classmethod
    def _hosts_named(cls, value: str) -> str:
        # "a,,b" or "a, b c" would send a rank's batches to no host, or to a name no resolver answers.
        if any(not h.strip() or any(c.isspace() for c in h.strip()) for h in value.split(",")):
            raise ValueError(f"{value!r}: every comma-separated host must be a name or address without spaces")
        return value

    @property
    def hosts(self) -> list[str]:
        return [h.strip() for h in self.host.split(",")]


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


SECRET_ENV = "PRIME_TRANSPORT_SECRET"


def secret_path(run_dir: RunDir) -> Path:
    return run_dir.root / "transport.secret"


def new_transport_secret(run_dir: RunDir) -> None:
    """A fresh secret for this launch (the launcher, before it starts anything): the processes of an earlier launch,
    which still hold the old one, can no longer feed this run's trainer. Written atomically, mode 0600."""
    atomic_write_bytes(secret_path(run_dir), secrets.token_hex(32).encode())


def transport_secret(run_dir: RunDir) -> bytes:
    """The secret every zmq message of this run is signed with: ``$PRIME_TRANSPORT_SECRET``, else the run's
    ``transport.secret`` (created by whichever process comes first when no launcher wrote one)."""
    if value := os.environ.get(SECRET_ENV):
        return value.encode()
    path = secret_path(run_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another process of the run made it first: use theirs
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    try:  # a FIFO there (mode 0600) blocked every process of the run in open
        value = read_regular(path, "a transport secret", limit=4096, private=True).strip()
    except ExposedFile as e:
        raise ConfigError(f"{e}: chmod 600 it (or set ${SECRET_ENV})") from None
    except UnreadableFile as e:
        raise ConfigError(f"{e} (delete it)") from None
    if len(value) < 16:
        raise ConfigError(f"{path} holds {len(value)} bytes: a transport secret needs at least 16 (delete it)")
    return value


def make_sender(config: RolloutTransportConfig, run_dir: RunDir, num_ranks: int) -> RolloutSender:
    if config.type == "filesystem":
        return FilesystemSender(run_dir)
    from prime_core.transport_zmq import ZmqSender

    return ZmqSender(config, num_ranks, transport_secret(run_dir))


def make_receiver(config: RolloutTransportConfig, run_dir: RunDir, rank: int, on_wait=None) -> RolloutReceiver:
    if config.type == "filesystem":
        return FilesystemReceiver(run_dir, rank, on_wait=on_wait)
    from prime_core.transport_zmq import ZmqReceiver

    return ZmqReceiver(config, rank, transport_secret(run_dir), on_wait=on_wait)
