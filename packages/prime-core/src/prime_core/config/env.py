"""One verifiers environment of a run (``orchestrator.env``, ``eval.env``, ``orchestrator.eval.envs``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from prime_core.config.base import BaseConfig
from prime_core.config.distill import DistillConfig
from prime_core.config.shared import MAX_WORKERS


def _positive_turns(value: int | str | None) -> int | str | None:
    if isinstance(value, int) and value < 1:
        raise ValueError(f"must be at least 1, 'auto' or None, got {value}")
    return value


MaxTurns = Annotated[int | Literal["auto"] | None, AfterValidator(_positive_turns)]


class EnvConfig(BaseConfig):
    """One verifiers environment, run by verifiers' own env server in a subprocess (what ``vf-eval`` would run)."""

    id: str
    """Taskset id: an installed package exporting a verifiers Taskset (e.g. reverse-text), as ``--env.taskset.id``."""
    name: str | None = None
    """Name in metrics (default: the id); must be unique."""
    ratio: float = Field(default=1.0, gt=0)
    """Relative sampling weight of this environment in a training batch."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Taskset config fields (e.g. num_examples, seed)."""
    env_id: str = ""
    """A verifiers Env to pair with the taskset (empty: the taskset's bundled Env, else the single-agent env)."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Other fields of the verifiers EnvConfig (env knobs, per-role agent settings such as ``agent.timeout``)."""
    harness: str = "auto"
    """Harness id of every agent seat (``null``, ``bash``, ``prime-chat``, an installed harness). ``auto``: what the
    environment gives each seat, as ``vf-eval`` would (the seat's own pin, else the taskset's bundled harness, else
    verifiers' ``bash``). A seat played by verifiers' ``null`` chat loop on a local runtime runs that loop
    in-process (``prime-chat``)."""
    harness_args: dict[str, Any] = Field(default_factory=dict)
    """Harness config fields."""
    runtime: str = "auto"
    """Verifiers runtime the harness program runs in, by its type name (``subprocess``, ``docker``, ``prime``,
    ``sandbox_pool``, ...). ``auto``: the runtime the environment declares for the seat, else ``subprocess`` (a
    local process; verifiers' own default is a hosted sandbox)."""
    runtime_args: dict[str, Any] = Field(default_factory=dict)
    """Runtime config fields (e.g. a docker image)."""
    allow_host_commands: bool = False
    """RL only: let a seat whose harness runs the model's commands (any harness but a chat loop: ``bash``, a coding
    agent) run them on this host, in the ``subprocess`` runtime, with the host's files, network and processes. Off,
    such a training environment (or an eval of the run, ``orchestrator.eval.envs``: it samples the policy being
    trained) stops the run at start with one line naming it: the policy is optimised against the environment and
    would find the host (its secrets, the trainer's processes, the files that grade it). Isolate the seat instead
    (``runtime = "sandbox_pool"``: the local sandbox, offline, see docs/sandboxes.md; or ``docker``, ``podman``,
    ``prime``) or play it as chat (``harness = "null"``)."""
    max_turns: MaxTurns = "auto"
    """Upper bound on model turns of every agent seat (None: no limit). ``auto``: the limit the environment declares
    for the seat (``vf.AgentConfig(max_turns=...)``), else none, as ``vf-eval`` would run it; every episode still ends
    at ``rollout_timeout`` and where the model's context is full."""
    num_workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    """Worker processes of the env server (1: one server process; more: verifiers' broker over a worker pool)."""
    elastic: bool = False
    """Start the pool with one worker and grow it with the load up to num_workers (static when off)."""
    rollout_timeout: float = Field(default=600.0, gt=0)
    """Seconds one rollout may take; a slower one counts as failed (see ``failed_rollouts``)."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher for this environment (unset: RL on its reward)."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.id


def check_unique_names(envs: list[EnvConfig]) -> list[EnvConfig]:
    """``envs`` if their names (``name``, else the id) are unique, else a ValueError naming the repeated one: two
    environments of one name shared one pool and one set of metrics, and the second silently replaced the first."""
    names = [e.resolved_name for e in envs]
    if repeated := next((n for n in names if names.count(n) > 1), None):
        raise ValueError(f"environment names must be unique, {repeated!r} is given twice (set `name` on one of them)")
    return envs
