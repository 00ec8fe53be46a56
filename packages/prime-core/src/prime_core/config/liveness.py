"""Liveness: how ``rl`` (and a SLURM job) finds a process that is alive but stuck, and how the orchestrator survives
environments that fail (docs/liveness.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prime_core.config.base import BaseConfig


class LivenessConfig(BaseConfig):
    """The launcher's watchdog: every process of the run reports a heartbeat and what it is doing
    (``<output_dir>/progress/``); the inference servers are probed at ``/health``. A process is declared stuck when its
    heartbeat stops, a server stops answering, or an activity runs past its bound (the longest the operation may take,
    from the process's config or learned from earlier steps) by more than ``slack_s``; ``rl`` then prints one line
    naming it and what it was waiting for, stops every process and exits non-zero."""

    enabled: bool = True
    """Watch the processes (off: only exits are noticed)."""
    slack_s: float = Field(default=30.0, gt=0, le=3600)
    """Seconds beyond the longest expected operation before a process is declared stuck; also how long a process may
    go without a heartbeat, and an inference server without answering ``/health``."""
    probe_timeout_s: float = Field(default=5.0, gt=0, le=600)
    """Seconds one ``/health`` request may take (the probe repeats every second until ``slack_s`` has passed)."""
    startup_s: float = Field(default=60.0, gt=0)
    """Seconds a started process may take to write its first heartbeat (interpreter and config parsing, before the
    heavy imports)."""
    step_timeout_s: float | None = Field(default=None, gt=0)
    """Longest a trainer step, weight publish or checkpoint may take. Unset: learned, ``learned_factor`` times the
    slowest one so far and at least ``learned_floor_s``; one of a kind never seen (the first step's compilation, the
    first checkpoint) gets ``first_timeout_s``."""
    learned_factor: float = Field(default=4.0, ge=1, le=1000)
    """Learned bound of a step, publish or checkpoint: this many times the slowest one so far."""
    learned_floor_s: float = Field(default=60.0, gt=0)
    """Learned bounds are at least this long (a step time jumps when a longer batch or a checkpoint lands)."""
    first_timeout_s: float = Field(default=1800.0, gt=0)
    """Bound of a step, publish or checkpoint of a kind never finished before (compilation, first save)."""


class RecoveryConfig(BaseConfig):
    """What the orchestrator does when an environment fails: env-server workers and tool servers that hang are
    replaced like those that die, their rollouts re-run (``max_rollout_retries``); a step goes on while enough of its
    rollouts succeed."""

    min_ok_fraction: float = Field(default=0.5, ge=0, le=1)
    """Share of a step's rollouts that must succeed. Fewer stops the run with one line naming the environments and the
    first error; failed rollouts of a step that goes on count as ``failed_rollouts`` says."""
    probe_timeout_s: float = Field(default=30.0, gt=0)
    """An env server, or a worker of its pool, that does not answer a health probe for this long (its event loop is
    blocked: a reward function that never returns) is replaced; a process of it stopped by a signal is killed at once."""
    env_memory_gb: float | None = Field(default=None, gt=0)
    """GiB of memory each process of an env server (a worker, a tool server, a program it starts) may allocate; past
    it an allocation fails in that process (a reward's ``MemoryError``: its rollout fails, counted) instead of the host
    running out and the OOM killer ending another process of the run. Unset: half of the host's memory."""
    max_answer_mb: float = Field(default=8.0, gt=0)
    """MB a rollout's answer from its env server may carry in each part beyond its completion: a trace's ``info``,
    ``metrics`` or ``errors`` past it are dropped in the env server (counted in ``env_servers/<env>/dropped_fields``);
    any other part past it (a trace's ``rewards``, ``stop_condition``, header, ...; the episode head) fails the rollout
    in one line. The prompt and completion tokens are never cut."""
    max_text_chars: int = Field(default=65536, ge=1024)
    """A rollout's prompt and completion text (log tables only) is cut to this many characters; a rollout whose
    reward or metrics are not finite counts as failed."""


class WatchConfig(BaseConfig):
    """``prime-launch watch``: the watchdog of ``rl`` beside processes started by someone else (a multi-node SLURM
    job). It reads their heartbeats under ``output_dir`` and probes the inference servers, and exits 1 with one line
    naming the first stuck process (the job then stops every step)."""

    output_dir: Path = Path("outputs")
    """The run directory the processes share (their heartbeats are under ``progress/``)."""
    orchestrator: bool = True
    """Watch the orchestrator's heartbeat."""
    trainer_ranks: int = Field(default=1, ge=0)
    """Trainer ranks whose heartbeats to watch (0: none)."""
    health_urls: list[str] = Field(default_factory=list)
    """``/health`` URLs of the inference servers to probe."""
    api_key_var: str | None = None
    """Environment variable holding the inference API key, if the servers require one."""
    liveness: LivenessConfig = Field(default_factory=LivenessConfig)
    """Bounds, as for ``rl``."""
