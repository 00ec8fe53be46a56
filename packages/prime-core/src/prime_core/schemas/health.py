"""``GET /health`` of an inference server: what the launcher, the orchestrator and ``eval`` read about a server.

The server answers 200 with this body once its engine is up. Engine-specific details (the torch engine's decoder,
vLLM's plugin status) ride along as extra keys; a client validates what it reads (``parse_health``), so a server of
another version or a stand-in that answers only some of the fields still parses.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class HealthResponse(BaseModel):
    """The state of one inference server."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    status: str = "ok"
    """``ok`` once the engine serves."""
    engine: str | None = None
    """``torch`` or ``vllm``."""
    model: str | None = None
    """The served model name (what requests name)."""
    model_name: str | None = None
    """The server config's ``model.name`` (a directory or hub id), which requests may also carry."""
    weight_step: int | None = None
    """The weight step served (0: the base weights of ``model.name``)."""
    weight_dir: str | None = None
    """Where the served weights came from (None: ``model.name``)."""
    paused: bool = False
    """Scheduling is paused (``/pause``): requests queue."""
    max_model_len: int | None = None
    """Longest prompt plus completion, in tokens."""
    adapters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Served LoRA adapters: name -> {"path", "weight_step"}."""
    run_id: str | None = None
    """``PRIME_RUN_ID`` of the launch that started the server (the launcher tells its own server from another)."""
    running: int = 0
    """Requests the engine is generating for."""
    waiting: int = 0
    """Requests queued for a free slot."""
    kv_cache_usage: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fraction of the engine's KV cache that requests hold, 0..1 (vLLM: KV blocks in use; torch: cached tokens over
    ``max_batch_size`` x ``max_model_len``). None: the engine does not say. The orchestrator's adaptive concurrency
    (``client.concurrency``) grows the rollouts in flight while it stays below its target."""
    preemptions: int | None = Field(default=None, ge=0)
    """Requests the engine evicted from its KV cache for lack of room since it started (they re-run their prefill
    later), cumulative. None: the engine does not say. The torch engine never preempts: 0."""
    engine_steps: int | None = None
    """Steps the engine made so far (None: it does not count them): a watchdog sees an engine that holds running
    requests but no longer advances."""


def parse_health(data: Any) -> HealthResponse:
    """A ``/health`` body as read by a client; anything but a JSON object reads as a bare ``ok``."""
    if not isinstance(data, dict):
        return HealthResponse()
    try:
        return HealthResponse.model_validate(data)
    except ValueError:
        pass
    # A field of another type (another version): keep every field that validates, so a health check never fails on it.
    kept = {}
    for key, value in data.items():
        try:
            HealthResponse.model_validate({key: value})
        except ValueError:
            continue
        kept[key] = value
    return HealthResponse.model_validate(kept)
