"""What a process of a run says about itself, for the launcher's watchdog (``prime_launch.watchdog``).

Every process of a run (inference, orchestrator, each trainer rank) rewrites ``progress/<name>.json`` in the run
directory about once a second from a background thread (``prime_core.progress``): a heartbeat (``time``) and what it is
doing, one ``Activity`` per lane of work that runs concurrently (the orchestrator generates one step's rollouts while
it ships the previous one and relays weights). A process that is alive but stuck shows it in one of two ways: its
heartbeat stops (SIGSTOP, a frozen host), or an activity runs past its bound.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

HEARTBEAT_INTERVAL_S = 1.0
"""How often a process rewrites its progress file."""


class Activity(BaseModel):
    """One thing a process is doing, since when, and how long it may take."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lane: str = "main"
    """Which concurrent part of the process does it (``main``; the orchestrator's ``rollouts``, ``ship``, ``relay``)."""
    what: str
    """What it does or waits for, as a phrase for the one-line cause: ``training step 3``, ``waiting for the
    orchestrator's rollouts of step 3 (rollouts/step_3/rank_0.safetensors)``."""
    kind: str = ""
    """A kind of work whose duration the watchdog learns (``step``, ``publish``, ``checkpoint``); empty otherwise."""
    since: float
    """Unix time the activity began (or last made progress: a rollout finished)."""
    for_s: float | None = None
    """Seconds it had lasted at this heartbeat, on the process's monotonic clock: a step of the wall clock (NTP, a
    resumed VM) does not move it, as it moves ``since``. None from a writer that does not say."""
    limit_s: float | None = None
    """Longest it may take, from the process's own config (a rollout timeout, a weight-update timeout). None: the
    watchdog learns a bound for its ``kind``, or, for a wait on another process (``waits_for``), watches that one."""
    waits_for: str | None = None
    """The process this activity waits for (``trainer``, ``orchestrator``, ``inference``): the one to blame when
    the activity runs past its limit."""


class Progress(BaseModel):
    """A process's heartbeat and activities: ``progress/<process>.json``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    process: str
    """``inference``, ``orchestrator``, ``trainer``; or a helper a process of the run started (``sandbox_pool``: the
    sandbox pool of an env-server worker, ``progress/sandbox_pool_<pid>.json``)."""
    rank: int | None = None
    """Trainer rank (torchrun's ``RANK``); None for the other processes."""
    pid: int
    """Process id (on ``host``)."""
    host: str = ""
    """Host name: a pid means something only there."""
    run_id: str | None = None
    """``PRIME_RUN_ID`` of the launch that started the process: a file left by an earlier launch is ignored."""
    started: float
    """Unix time the process started reporting."""
    time: float
    """Unix time of this heartbeat."""
    monotonic: float | None = None
    """``time.monotonic()`` of this heartbeat: CLOCK_MONOTONIC, one clock for every process of a host's boot
    (``boot_id``) that a wall-clock step does not move; a watchdog on the same boot measures the heartbeat's age on it."""
    boot_id: str = ""
    """The host's boot id (``/proc/sys/kernel/random/boot_id``; empty where there is none): ``monotonic`` compares only
    within one boot of one host."""
    step: int | None = None
    """The step the process works on (trainer: the step it trains next; orchestrator: the step it generates)."""
    activities: list[Activity] = Field(default_factory=list)
    """What it does now, one entry per busy lane; empty when idle."""
    slowest_s: dict[str, float] = Field(default_factory=dict)
    """Per activity kind, the longest a finished one took (the watchdog's learned bound starts from it)."""
    counters: dict[str, float] = Field(default_factory=dict)
    """Progress counters (rollouts done and failed, env-server restarts, engine steps)."""
    exiting: bool = False
    """The process finished its work and is shutting down: it must be gone soon."""

    @property
    def name(self) -> str:
        """``trainer rank 1`` for a rank, else the process name."""
        return f"{self.process} rank {self.rank}" if self.rank is not None else self.process

    def on_clock_of(self, boot_id: str) -> bool:
        """Whether ``monotonic`` compares with the ``time.monotonic()`` of a reader on boot ``boot_id``."""
        return self.monotonic is not None and bool(self.boot_id) and self.boot_id == boot_id

    def doing(self) -> str:
        """Every activity as one phrase (``idle`` without any)."""
        return "; ".join(a.what for a in self.activities) or ("exiting" if self.exiting else "idle")
