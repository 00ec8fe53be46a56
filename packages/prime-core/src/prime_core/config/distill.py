"""Config of on-policy distillation: an environment's teacher endpoint and signal weights (``[orchestrator.env.distill]``),
and the teacher server that ``rl`` starts for them (``[teacher]``). See docs/algorithms.md, "On-policy distillation"."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import BaseConfig
from prime_core.config.inference import TorchEngineConfig, VllmConfig
from prime_core.config.shared import MAX_BATCH, MAX_COEF, MAX_RETRIES, MAX_SEQ_LEN, HttpUrl, ModelConfig


class TeacherConfig(BaseConfig):
    """A frozen teacher model behind an OpenAI-compatible server that serves the token-in route
    ``/inference/v1/generate`` with ``prompt_logprobs`` (prime's ``inference`` with either engine, or vLLM with
    prime's app)."""

    base_url: HttpUrl | None = None
    """The server's base URL (with or without ``/v1``), e.g. ``http://127.0.0.1:8001``. Unset: the teacher server
    ``rl`` starts from ``[teacher]`` (a standalone orchestrator needs it set)."""
    model: str | None = None
    """Model name the requests carry (the server's served model). Unset: the model of the teacher ``rl`` starts."""
    tokenizer: str | None = None
    """A local directory (or ``tokenizer.json``) with the teacher's tokenizer, compared with the student's at start;
    unset: the server's ``/tokenize`` is compared on probe texts."""
    api_key_var: str | None = None
    """Environment variable holding the server's API key (unset: no key)."""
    timeout: float = Field(default=120.0, gt=0)
    """Seconds one scoring request may take; after ``max_retries`` the run stops, naming the teacher."""
    max_retries: int = Field(default=3, ge=0, le=MAX_RETRIES)
    """Retries of a scoring request on connection errors and 5xx (then a teacher that is gone is waited for, up to
    ``health_timeout``, and the request asked once more)."""
    max_concurrent: int = Field(default=32, ge=1)
    """Scoring requests in flight to this teacher."""
    health_timeout: float = Field(default=300.0, gt=0)
    """Seconds to wait for the teacher's /health at start (``rl`` raises it to its own ``health_timeout`` for the
    teacher it starts), and again when it stops answering during the run (a restart of its server)."""

    @field_validator("base_url")
    @classmethod
    def _bare_url(cls, v: str | None) -> str | None:
        return None if v is None else v.rstrip("/").removesuffix("/v1")


class DistillConfig(BaseConfig):
    """On-policy distillation of one environment (see docs/algorithms.md ## On-policy distillation): the teacher
    scores the student's own sampled tokens; each token's advantage is ``reward_weight * A + kl_weight * (log
    p_teacher - log p_student)``, the negative per-token reverse KL plus the task advantage."""

    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    """The teacher model (default: the one ``rl`` starts from ``[teacher]``)."""
    kl_weight: float = Field(default=1.0, ge=0, le=MAX_COEF)
    """Weight of the per-token distillation signal (the negative reverse KL on the sampled token)."""
    reward_weight: float = Field(default=0.0, ge=0, le=MAX_COEF)
    """Weight of the environment's group advantage (0: pure distillation; the reward is still logged)."""
    privileged_prompt: str | None = None
    """Text the teacher reads before the student's tokens and the student never sees (self-distillation, ``opsd``:
    a hint, a rubric, a style guide). Written in the model's own chat format, e.g. a ChatML system turn
    ``"<|im_start|>system\\n...<|im_end|>\\n"``; tokenized with the student's tokenizer, special tokens included.
    The teacher's log-probs of the student's tokens are then conditioned on it."""

    @model_validator(mode="after")
    def _trains_something(self) -> DistillConfig:
        # Both 0 made every token's advantage 0: the env ran, scored and trained nothing, never saying so (its groups
        # are kept for the teacher's signal, so the zero-advantage filter does not drop them either).
        if self.kl_weight == 0 and self.reward_weight == 0:
            raise ValueError(
                "kl_weight and reward_weight are both 0: every token's advantage would be 0 (remove distill for RL on "
                "the env's reward)"
            )
        return self


class TeacherServerConfig(BaseConfig):
    """A frozen teacher that ``rl`` serves for on-policy distillation: one more inference process with its own devices,
    port and log (``logs/teacher.log``), watched like the policy's server and never sent a weight update. Every
    environment with ``distill`` whose ``teacher.base_url`` is unset scores with it."""

    model: ModelConfig | None = None
    """Teacher weights (HF directory or hub id) and dtype. Unset: the student's ``model``, i.e. the frozen initial
    policy (self-distillation, with a ``distill.privileged_prompt``)."""
    engine: Literal["auto", "vllm", "torch"] = "auto"
    """Engine: auto is vLLM on a GPU run and the torch engine on a CPU run (vLLM needs a GPU)."""
    port: int = Field(default=8001, ge=1, le=65535)
    """TCP port on 127.0.0.1 (the orchestrator on this host is its only client); must differ from the policy's."""
    num_gpus: int = Field(default=1, ge=1)
    """GPU run: GPUs of the teacher, the ones after the inference server's and the trainer's (vLLM data parallel
    over them: DP = GPUs / tensor parallel)."""
    gpu_ids: list[int] | None = None
    """GPU run: the teacher's GPUs by id instead. They may be GPUs of the other processes: then set
    ``vllm.gpu_memory_utilization`` to the share of each GPU's memory the teacher may take."""
    max_model_len: int | None = Field(default=None, ge=2, le=MAX_SEQ_LEN)
    """Longest sequence it scores (prompt + completion); unset uses the model's ``max_position_embeddings``."""
    max_batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Torch engine: sequences prefilled together."""
    torch: TorchEngineConfig = Field(default_factory=TorchEngineConfig)
    """PyTorch engine settings (CPU threads: ``num_threads`` or ``devices.cpu_threads.teacher``)."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """vLLM engine settings (passed through)."""
