"""LoRA adapters in the torch engine: which adapters are served, and per-row adapter routing around the decoder.

Requests choose an adapter by name (the OpenAI ``model`` field); a running batch may mix adapters and the base
model. `AdapterRouter` wraps the decoder: before each prefill or decode it tells the model's LoRA layers
(`prime_models.lora`) which adapter each batch row uses, looked up by the row's KV-cache slot.

Shape legend: B batch rows.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class ServedAdapter:
    name: str
    path: str
    step: int | None

    def card(self) -> dict[str, Any]:
        return {"path": self.path, "weight_step": self.step}


@dataclass
class AdapterOp:
    """Load (``path`` set) or unload an adapter between scheduler steps, once no running sequence uses it."""

    name: str
    path: str | None
    """The PEFT directory to load (or, with ``received``, what the tensors came from); None unloads."""
    step: int | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    received: tuple[Any, dict[str, Any]] | None = None
    """(`prime_models.lora.LoRASpec`, PEFT-keyed tensors) received from a streamed transport, loaded instead of a
    directory."""

    def load_into(self, model: nn.Module) -> None:
        from prime_models import lora

        if self.received is not None:
            lora.install_adapter(model, self.name, *self.received, source=str(self.path))
        else:
            lora.load_adapter(model, self.name, self.path)


def received_adapter(manifest: Any, device: Any) -> tuple[Any, dict[str, Any]]:
    """The LoRA adapter a streamed manifest (`prime_core.schemas.weights.CudaIpcManifest` with ``adapter``) hands
    over: its spec, from the PEFT config, and copies of its tensors (the transport reuses its buffers)."""
    from prime_models.lora import LoRASpec

    from prime_inference.weights import stream_receiver

    spec = LoRASpec.from_peft_config(manifest.adapter.peft_config)
    buckets = stream_receiver(manifest).tensors(manifest, device)
    return spec, {name: t.clone() for bucket in buckets for name, t in bucket}


class AdapterRouter:
    """A decoder (`CachedDecoder` or `RecomputeDecoder`) whose rows are served by per-slot adapters."""

    def __init__(self, decoder: Any, model: nn.Module):
        self.decoder = decoder
        self.model = model
        self.slot_adapters: dict[int, str | None] = {}

    @property
    def name(self) -> str:
        return type(self.decoder).__name__

    def set_model(self, model: nn.Module, hf_config: Any) -> None:
        self.decoder.set_model(model, hf_config)
        self.model = model

    def release(self) -> None:
        self.decoder.release()

    @contextmanager
    def _rows(self, slots: list[int]) -> Iterator[None]:
        from prime_models.lora import set_row_adapters

        rows = [self.slot_adapters.get(s) for s in slots]
        if all(r is None for r in rows) and getattr(self.model, "lora_selection", None) is None:
            yield  # no adapter was ever loaded: the model has no LoRA layers to route
            return
        set_row_adapters(self.model, rows)
        try:
            yield
        finally:
            set_row_adapters(self.model, None)

    def prefill(self, slot: int, token_ids: list[int], *args: Any, **kwargs: Any):
        with self._rows([slot]):
            return self.decoder.prefill(slot, token_ids, *args, **kwargs)

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        self.decoder.copy_prompt(src, dst, length)

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int], *args: Any, **kwargs: Any):
        with self._rows(list(slots)):
            return self.decoder.decode(slots, token_ids, positions, *args, **kwargs)
