"""What crosses the orchestrator's process boundaries: env server specs in, rollout results out.

An env server (a subprocess per environment, verifiers' own) is started from an ``EnvServerSpec``; each episode it
plays comes back as verifiers traces (one per agent run), which the orchestrator turns into one ``RolloutResult`` per
rollout: per trace, its seat, its own reward and the trained token stream of every turn (env/tool tokens masked) with
the inference log-probs of the sampled tokens, and the policy versions that sampled them (``PolicyVersions``, read
from an inference server's version record with ``RolloutVersionsRequest``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

ROLLOUT_TAG = "prime_rollout"
"""Key in a token-in request's ``sampling_params.extra_args`` naming the rollout the request belongs to: the inference
server records which weight steps sampled the tokens of each tag (``POST /rollout_versions``)."""


MIN_WEIGHT_STEP = "prime_min_weight_step"
"""Key in a token-in request's ``sampling_params.extra_args``: the oldest weight step that may sample it. The inference
server holds the request until it serves that step (the orchestrator dispatches a step's rollouts before its weights
land, so the env side of every rollout is done by then: ``orchestrator.dispatch_ahead``)."""


class EnvServerSpec(BaseModel):
    """How one environment's verifiers env server is started."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Environment name in metrics and logs."""
    env_config: dict[str, Any]
    """The verifiers ``EnvConfig`` as JSON data (taskset id and fields, agent harness/runtime, env knobs)."""
    num_workers: int = Field(default=1, ge=1)
    """Worker processes of the env server (1: a single server process, no broker)."""
    elastic: bool = False
    """Start with one worker and add workers as load grows, up to num_workers (verifiers' elastic pool)."""
    multiplex: int = Field(default=128, ge=1)
    """Rollouts one worker is sized for (the elastic pool grows at 90% of workers * multiplex in flight)."""
    start_timeout: float = Field(default=300.0, gt=0)
    """Seconds the server may take to come up."""
    probe_timeout_s: float = Field(default=30.0, gt=0)
    """A server (or pool worker) that answers no health probe for this long is hung and replaced."""
    max_memory_bytes: int | None = Field(default=None, gt=0)
    """Memory each process of the server may allocate (soft ``RLIMIT_DATA``; None: half of the host's memory)."""
    max_answer_bytes: int = Field(default=8_000_000, gt=0)
    """Bytes each capped part of a rollout's answer may have (``prime_orchestrator.answer_cap``)."""


class PolicyVersions(BaseModel):
    """The policy versions (weight steps) that sampled a rollout's tokens."""

    model_config = ConfigDict(extra="forbid")

    first: int
    """Weight step that sampled the rollout's first token."""
    last: int
    """Weight step that sampled its last token."""
    num_tokens: int = 0
    """Sampled tokens the record covers (0: requests under way, none sampled yet or none reported yet)."""
    exact: bool = True
    """The engine recorded the step of every token as it was sampled. False: bounds, ``first`` no newer and ``last``
    no older than the truth (a server without the record, or vLLM without its log-prob tap)."""


class RolloutVersionsRequest(BaseModel):
    """``POST /rollout_versions`` of an inference server: what the tokens of tagged requests were sampled with."""

    model_config = ConfigDict(extra="forbid")

    tags: list[str] = Field(max_length=65536)
    """Rollout tags (``ROLLOUT_TAG``)."""
    pop: bool = False
    """Forget these tags once answered (the rollout finished)."""
    abort: bool = False
    """Abort the tags' requests still generating (a stale rollout): they answer 409 and sample nothing more."""


class RolloutVersionsResponse(BaseModel):
    """The answer: a record per known tag; a tag whose requests sampled nothing yet is absent."""

    model_config = ConfigDict(extra="forbid")

    versions: dict[str, PolicyVersions] = Field(default_factory=dict)
    """Tag -> the versions its tokens were sampled with so far."""
    aborted: int = 0
    """Requests aborted (``abort``)."""


class TrainedSequence(BaseModel):
    """One token sequence a rollout trains: a branch of a trainable verifiers trace. Turns that extend the previous
    turn's tokens share a sequence; a turn that does not (history rewritten, a turn cut at max_tokens and resumed)
    starts a new one, as verifiers starts a new branch."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(default_factory=list)
    """Every turn's tokens: prompt, sampled completions and the env/tool turns between them."""
    loss_mask: list[bool] = Field(default_factory=list)
    """True on model-sampled tokens (trained), False on prompt and env/tool tokens."""
    logprobs: list[float] = Field(default_factory=list)
    """Inference log-prob of each sampled token, 0.0 elsewhere."""
    images: list[str] = Field(default_factory=list)
    """data: URLs of the images whose placeholder runs ``token_ids`` holds (vision-language models)."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's log-prob of each token given the tokens before it (0.0 at position 0)."""

    @model_validator(mode="after")
    def _aligned(self) -> TrainedSequence:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs ({len(self.logprobs)}) must align"
            )
        return self


class TraceResult(BaseModel):
    """One agent run of an episode (a verifiers trace): the unit of credit. A two-player game has one per seat; an
    env that runs a seat several times (attempts scored against each other) has one per attempt."""

    model_config = ConfigDict(extra="forbid")

    seat: str = "agent"
    """The seat that played it: verifiers' agent name (the env config's role field, e.g. ``player``)."""
    trainable: bool = True
    """The seat trains the policy (verifiers' ``trace.agent.trainable``; a simulated user or a judge does not)."""
    reward: float = 0.0
    """The trace's own reward (the weighted sum of its named rewards): its sequences train on it."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Its named rewards (``reward/<name>``, weighted as they count in ``reward``) and metrics."""
    num_turns: int = 0
    """Model turns it sampled."""
    replaced_replies: int = 0
    """Model replies the environment replaced before anything read them (verifiers' ``response_rewrites`` of an
    ``@vf.intercept`` on the response): verifiers keeps none of their tokens, so a trace of only such replies trains
    nothing and is no empty completion."""
    sequences: list[TrainedSequence] = Field(default_factory=list)
    """Its trainable branches (none for an untrainable seat)."""

    @property
    def completion_len(self) -> int:
        return sum(sum(s.loss_mask) for s in self.sequences)


class RolloutResult(BaseModel):
    """One rollout, as the trainer-facing side of the orchestrator needs it."""

    model_config = ConfigDict(extra="forbid")

    env: str
    """Environment name."""
    example: int
    """Index of the task in the environment's task stream."""
    traces: list[TraceResult] = Field(default_factory=list)
    """The scored traces: every trainable one (each trains on its own reward and advantage); when no seat trains
    (an eval of fixed agents), all of them. Untrainable seats beside trainable ones train nothing and do not score."""
    reward: float = 0.0
    """Summary reward of the rollout: the mean over its scored traces (what eval and ``reward/mean`` report)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Named rewards and metrics the environment recorded, averaged over a seat's traces; ``<seat>/<name>`` when
    the episode has several seats."""
    num_turns: int = 0
    """Model turns sampled by the scored traces."""
    prompt_len: int = 0
    """Tokens before the first sampled token of the first sequence."""
    completion_len: int = 0
    """Sampled tokens over all sequences."""
    truncated: bool = False
    """A turn stopped at max_tokens, or the episode hit a turn/token limit."""
    failed: bool = False
    """The rollout raised or timed out (its reward is 0; it carries no tokens)."""
    error: str | None = None
    """One-line description of the failure."""
    latency: float = 0.0
    """Wall seconds of the episode."""
    scoring_s: float = 0.0
    """Wall seconds of its rewards and metrics (verifiers' scoring span; sandboxed tests run there)."""
    versions: PolicyVersions | None = None
    """Weight steps that sampled its first and last token (None: it sampled nothing, or nobody recorded them)."""
    prompt: str = ""
    """The prompt as the model saw it (messages before the first sampled turn)."""
    completion: str = ""
    """The conversation from the first sampled turn on."""

    @property
    def sequences(self) -> list[TrainedSequence]:
        """Every trained sequence of the rollout, trace by trace."""
        return [s for t in self.traces for s in t.sequences]

    @property
    def seats(self) -> list[str]:
        """The scored seats, in the order their first trace finished."""
        return list(dict.fromkeys(t.seat for t in self.traces))

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)
