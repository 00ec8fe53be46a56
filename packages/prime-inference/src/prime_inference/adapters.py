"""LoRA adapter directories as ``POST /v1/load_lora_adapter`` (vLLM's API) accepts them: inside the weight roots,
PEFT-shaped.

Adapters reach the server three ways: that route (any PEFT LoRA directory, served under the name the request
gives), ``POST /update_weights`` with a trainer-published adapter directory (the adapter transport,
`prime_inference.weights.adapter`; this is how the orchestrator relays each step of a LoRA run), and
``lora.adapters`` in the config (loaded at start-up). Requests select an adapter with ``"model": "<name>"``.
"""

from __future__ import annotations

from pathlib import Path

from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir

from prime_inference.protocol import RequestError
from prime_inference.weights.base import confined_dir, confined_files


def check_adapter_dir(path_str: str, roots: list[Path], param: str = "lora_path") -> Path:
    """A PEFT adapter directory inside the weight roots."""
    path = confined_dir(path_str, roots, param)
    if not is_adapter_dir(path):
        raise RequestError(f"{param} {path_str} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}", param=param)
    confined_files(path, roots, param)
    return path
