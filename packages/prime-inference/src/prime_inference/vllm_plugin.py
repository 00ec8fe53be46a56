"""vLLM seams: the ``vllm.general_plugins`` entry point and the worker extension class.

`register` runs in every vLLM process (API server, engine core, workers) through the entry point declared in
prime-inference's pyproject. `PrimeWorkerExtension` is mixed into vLLM's GPU worker (``worker_extension_cls``), so
its methods are callable with ``collective_rpc``; ``self`` is the worker (``self.model_runner`` etc.).

This module imports neither torch nor vllm at import time: vLLM resolves the extension by name in its workers.
"""

from __future__ import annotations

import os
from typing import Any

_REGISTERED = False


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Idempotent: vLLM may call it several times per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    # The engine core must run in spawned processes (CUDA cannot be re-initialized in a fork).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from prime_inference.engines.vllm_load import install_probe_if_engine_core

    # The engine core answers /health's load questions (KV-cache usage, queue, preemptions) with vLLM's stats off.
    install_probe_if_engine_core()


def plugin_registered() -> bool:
    return _REGISTERED


class PrimeWorkerExtension:
    """Worker-side RPCs for prime (``collective_rpc("prime_...")``)."""

    def prime_plugin_status(self) -> dict[str, Any]:
        """Proves the extension is mixed in and whether the general plugin ran in this worker process."""
        return {"general_plugin": plugin_registered(), "pid": os.getpid()}

    def prime_install_token_logprobs(self) -> bool:
        """Hook the sampled-log-prob tap into this worker's model runner (`prime_inference.token_logprobs`); False
        where the runner cannot be tapped (vLLM's V1 runner, speculative decoding, a pipeline rank that does not
        sample)."""
        from prime_inference.token_logprobs import SampledLogprobTap

        if getattr(self, "_prime_tap", None) is None:
            self._prime_tap = SampledLogprobTap.install(self.model_runner)  # type: ignore[attr-defined]
        return self._prime_tap is not None

    def prime_take_token_logprobs(self, request_ids: list[str]) -> dict[str, Any]:
        """The tapped (positions, token ids, log-probs) of these requests, forgotten here once handed over."""
        tap = getattr(self, "_prime_tap", None)
        return {} if tap is None else tap.take(request_ids)

    def _prime_serve_version(self, version: int | None) -> None:
        """Sampled log-probs collected from here on carry ``version`` (`prime_inference.token_logprobs`)."""
        tap = getattr(self, "_prime_tap", None)
        if tap is not None and version is not None:
            tap.set_version(version)

    def prime_reload_weights(self, weights_path: str, version: int | None = None) -> str | None:
        """Layerwise in-place reload from an HF directory (or the base model id) via vLLM's own reload; ``version``:
        the weight step it serves. Returns why the loaded weights must not be served, or None.

        The server has already confined the path to the weight roots and checked its STABLE marker.
        """
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        refusal = self._prime_refuse_nonfinite(version)
        if refusal is None:
            self._prime_serve_version(version)
        return refusal

    def prime_receive_weights(self, manifest: dict[str, Any], version: int | None = None) -> str | None:
        """Receive a streamed weight update into this worker's model (vLLM maps HF names to its fused layers): the
        manifest's transport (`prime_inference.weights.StreamReceiver`) yields the buckets. Returns why the loaded
        weights must not be served, or None.
        """
        import torch
        from prime_core.schemas.weights import parse_manifest

        from prime_inference.weights import stream_receiver

        parsed = parse_manifest(manifest)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        device = torch.device("cuda", torch.cuda.current_device())
        for bucket in stream_receiver(parsed).tensors(parsed, device):
            model.load_weights(weights=bucket)
        refusal = self._prime_refuse_nonfinite(version)
        if refusal is None:
            self._prime_serve_version(version)
        return refusal

    def _prime_refuse_nonfinite(self, version: int | None) -> str | None:
        """Why weights holding a NaN or an infinity must not be served, checked once loaded (vLLM loads in place, so
        only after): served, every logit is NaN and each request samples token 0 under the new step's name. One
        reduction per tensor on the GPU and one synchronisation, small beside the load. Returned, not raised: the
        engine core logs a worker's exception as a traceback, and a refusal is a one-line answer to the update."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        floats = [
            (n, p) for n, p in model.named_parameters() if p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ]
        if not floats:
            return None
        with torch.no_grad():
            bad = torch.stack([~torch.isfinite(p).all() for _, p in floats])
        if not bool(bad.any()):
            return None
        name = floats[int(bad.nonzero()[0, 0])][0]
        return f"the weights of step {version} hold NaN or infinite values ({name})"

    def prime_receive_adapter(self, manifest: dict[str, Any], lora_int_id: int) -> int:
        """Receive a LoRA adapter's tensors from a streamed transport into this worker's host memory, for vLLM's
        loader to build as ``lora_int_id`` (`prime_inference.vllm_lora`). Returns the tensors received."""
        from prime_inference import vllm_lora

        return vllm_lora.receive(self, manifest, lora_int_id)

    def prime_weights_checksum(self) -> float:
        """Sum of every parameter in fp64 (tests use it to see that an update landed on every worker)."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))
