"""LoRA adapters handed to vLLM's workers as tensors (a streamed weight transport: CUDA IPC on a shared GPU), not as a
directory. Runs inside each worker, through `prime_inference.vllm_plugin.PrimeWorkerExtension`.

vLLM loads an adapter with its worker LoRA manager's ``_load_adapter(request)``, which reads ``request.lora_path``;
it calls it again whenever the adapter was evicted from its caches. `receive` takes the tensors from the transport,
keeps a host copy under the request's id and path (vLLM keeps LoRA weights in host memory too, and copies them into
its GPU slots), and wraps this worker's ``_load_adapter`` once so that a request naming that id and path is built
from the kept tensors (`LoRAModel.from_lora_tensors`); any other request (an adapter from files, the same name later
loaded from a directory) goes through vLLM's own loader. The engine then adds the adapter with vLLM's own
``add_lora`` (`prime_inference.engines.vllm_engine.VllmEngine.receive_adapter`).

vllm and torch are imported inside the functions, as in the worker extension.
"""

from __future__ import annotations

import inspect
from typing import Any

KEPT: dict[int, tuple[str, dict[str, Any], dict[str, Any]]] = {}
"""This worker's adapters received as tensors: lora_int_id -> (lora_path it is requested under, PEFT config, host
tensors by PEFT key). Replaced by the next step's."""


def ipc_path(manifest: Any) -> str:
    """The ``lora_path`` an adapter received from ``manifest`` is requested under: unique per store and step, never a
    directory vLLM could read."""
    return f"{manifest.type}://{manifest.host}:{manifest.port}/step_{manifest.step}"


def lora_manager(worker: Any) -> Any:
    """The worker's LoRA manager (vLLM's ``LRUCacheWorkerLoRAManager``)."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM worker has no LoRA manager at model_runner.lora_manager (is LoRA enabled?)")
    return manager


def receive(worker: Any, manifest: dict[str, Any], lora_int_id: int) -> int:
    """Take the adapter ``manifest`` hands over into host memory, for vLLM to load as ``lora_int_id``. Returns the
    tensors received."""
    import torch
    from prime_core.schemas.weights import parse_manifest

    from prime_inference.weights import stream_receiver

    parsed = parse_manifest(manifest)
    if getattr(parsed, "adapter", None) is None:
        raise ValueError(f"{parsed.type} step {getattr(parsed, 'step', '?')} hands over no LoRA adapter")
    install_loader(lora_manager(worker))
    device = torch.device("cuda", torch.cuda.current_device())
    tensors = {name: t.to("cpu", copy=True) for bucket in stream_receiver(parsed).tensors(parsed, device)
               for name, t in bucket}  # fmt: skip
    KEPT[lora_int_id] = (ipc_path(parsed), parsed.adapter.peft_config, tensors)
    return len(tensors)


def install_loader(manager: Any) -> None:
    """Wrap this manager's ``_load_adapter`` (once) to build kept adapters from their tensors."""
    if getattr(manager, "_prime_kept_loader", False):
        return
    original = manager._load_adapter

    def load_adapter(lora_request: Any) -> Any:
        kept = KEPT.get(lora_request.lora_int_id)
        if kept is None or kept[0] != lora_request.lora_path:
            return original(lora_request)
        return from_tensors(manager, lora_request.lora_int_id, kept[1], kept[2])

    manager._load_adapter = load_adapter
    manager._prime_kept_loader = True


def from_tensors(manager: Any, lora_int_id: int, peft_config: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """vLLM's ``LoRAModel`` of PEFT-keyed host ``tensors``, checked as vLLM checks an adapter from files. The keyword
    arguments ``from_lora_tensors`` takes differ between vLLM versions: those it does not name are left out."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(peft_config)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    offered = {
        "lora_model_id": lora_int_id,
        "tensors": tensors,
        "peft_helper": helper,
        "device": "cpu",
        "dtype": manager.lora_config.lora_dtype,
        "model_vocab_size": getattr(manager, "vocab_size", None),
        "weights_mapper": mapper,
        "skip_prefixes": getattr(model, "lora_skip_prefixes", None),
    }
    build = manager._lora_model_cls.from_lora_tensors
    accepted = inspect.signature(build).parameters
    lora = build(**{k: v for k, v in offered.items() if k in accepted})
    if lora.rank > manager.lora_config.max_lora_rank:
        raise ValueError(f"LoRA rank {lora.rank} is greater than max_lora_rank {manager.lora_config.max_lora_rank}")
    return lora
