"""The interface the HTTP server drives: one `Engine` per process, vLLM or PyTorch.

An engine generates one sequence per `EngineRequest` and streams `EngineOutput` deltas (new token ids, their
log-probs, and finally a finish reason). The server owns tokenization, chat templates, `n` fan-out and response
formatting, so both engines present the same HTTP surface.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prime_core.schemas.weights import Manifest

from prime_inference.protocol import RequestError, SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    multimodal: Any = None
    """Images of a vision-language prompt (``prime_inference.multimodal.MultiModalInput``); ``prompt_ids`` holds
    their expanded placeholder runs."""
    stream: bool = True
    """The caller consumes deltas as they come. False: nobody looks before the end, so an engine may deliver the
    whole sequence in one final output (vLLM then skips a Python wake-up per token and request)."""
    lora_name: str | None = None
    """LoRA adapter serving this request (the request's ``model``); None is the base model."""
    session: str | None = None
    """The rollout this request is a turn of (its ``prime_rollout`` tag): an engine of several may serve its turns
    where the previous one left its prefix cached."""


@dataclass
class EngineOutput:
    """A delta: tokens sampled since the previous output of the same request."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    """Per new token: {token id: log-prob} of the top-k alternatives (k = params.logprobs)."""
    finish_reason: str | None = None
    """None while running; then "stop" (EOS, stop token or stop string), "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence, if any."""
    weight_step: int | None = None
    """Weight step the engine served when this delta was sampled."""
    weight_steps: list[int] | None = None
    """The weight step that sampled each token, where a delta may span a weight update (vLLM's final-only outputs);
    None: every token of the delta was sampled with ``weight_step``."""
    versions_exact: bool = True
    """The steps were recorded as the tokens were sampled. False: bounds (the first token's no newer, the others' no
    older than the truth)."""
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    """First delta of a request with ``params.prompt_logprobs``: per prompt position, None for the first, else
    {token id: (log-prob, rank)} for the prompt's token and the top k alternatives (vLLM's prompt log-probs)."""


@dataclass
class EngineInfo:
    engine: str
    model: str
    max_model_len: int
    vocab_size: int
    weight_step: int = 0
    weight_dir: str | None = None
    paused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Served LoRA adapters: name -> {"path", "weight_step"}."""
    running: int = 0
    """Requests being generated."""
    waiting: int = 0
    """Requests queued for a free slot."""
    steps: int | None = None
    """Engine steps so far (None: the engine does not count them); a watchdog sees an engine that stopped advancing."""
    kv_cache_usage: float | None = None
    """Fraction of the KV cache held by requests, 0..1 (None: unknown); ``/health`` reports it."""
    preemptions: int | None = None
    """Requests evicted from the KV cache for lack of room since start, cumulative (None: unknown)."""


class Engine(abc.ABC):
    """Generation plus the admin operations of an RL inference server."""

    name: str
    supports_prompt_logprobs: bool = False
    """Whether `generate` fills `EngineOutput.prompt_logprobs` (text prompts on the base model)."""
    live_versions: bool = True
    """Each token reaches `generate`'s caller as it is sampled, with its weight step (so a request that has delivered
    nothing has sampled nothing). False: outputs may come at the end only (vLLM's non-streamed requests)."""

    @property
    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    async def start(self) -> None:  # noqa: B027
        """Called once inside the server's event loop before the first request."""

    async def shutdown(self) -> None:  # noqa: B027
        """Called once when the server stops."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas until one carries a finish reason. Closing the iterator early aborts the request."""

    # Weight transports (`prime_inference.weights`) drive the engine through these four primitives.

    @abc.abstractmethod
    async def update_weights(self, weight_dir: str, step: int | None) -> None:
        """Load HF safetensors from a checked directory (the filesystem transport)."""

    async def receive_weights(self, manifest: Manifest, step: int | None) -> None:
        """Where the model lives, run ``StreamReceiver.tensors`` of the manifest's transport, load every bucket and
        serve the result (the broadcast transport, and any other that streams tensors)."""
        raise RequestError(f"the {self.name} engine cannot receive {manifest.type} weights", param="weight_dir")

    async def load_adapter(self, name: str, path: str, step: int | None) -> None:
        """Serve the PEFT LoRA adapter in ``path`` under ``name``, replacing an adapter of that name."""
        raise RequestError(f"the {self.name} engine does not serve LoRA adapters", status_code=404)

    async def receive_adapter(self, name: str, manifest: Manifest, step: int | None) -> None:
        """Where the model lives, run ``StreamReceiver.tensors`` of the manifest's transport (a LoRA adapter's
        PEFT-keyed tensors) and serve them under ``name``, replacing an adapter of that name."""
        raise RequestError(f"the {self.name} engine cannot receive {manifest.type} adapters", param="weight_dir")

    @abc.abstractmethod
    async def reload_weights(self) -> None:
        """Go back to the base weights of ``model.name``."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``."""
        raise RequestError(f"the {self.name} engine does not serve LoRA adapters", status_code=404)

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling: in-flight requests keep their state and wait; new requests queue."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo `pause` (idempotent)."""
