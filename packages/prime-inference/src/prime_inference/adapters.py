"""LoRA adapter directories as the server accepts them: confined to the weight roots, PEFT-shaped.

Adapters reach the server three ways: ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (vLLM's API;
any PEFT LoRA directory), ``POST /update_weights`` with a trainer-published adapter directory (STABLE, named by
its ``prime_adapter.json``; this is how the orchestrator relays each step of a LoRA run), and
``lora.adapters`` in the config (loaded at start-up). Requests select an adapter with ``"model": "<name>"``.
"""

from __future__ import annotations

from pathlib import Path

from prime_core.io import is_stable
from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_INFO, ADAPTER_WEIGHTS, AdapterInfo, is_adapter_dir

from prime_inference.protocol import RequestError


def confined_dir(path_str: str, roots: list[Path], param: str) -> Path:
    """Resolve ``path_str`` (symlinks included); refuse relative paths and anything outside ``roots``."""
    if not path_str or "\x00" in path_str:
        raise RequestError(f"{param} must be a non-empty path", param=param)
    path = Path(path_str).expanduser()
    if not path.is_absolute():
        raise RequestError(f"{param} must be an absolute path", param=param)
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        raise RequestError(f"{param} cannot be resolved: {e}", param=param) from e
    if roots:
        allowed = [Path(r).expanduser().resolve() for r in roots]
        if not any(resolved == r or resolved.is_relative_to(r) for r in allowed):
            raise RequestError(f"{param} is outside the server's weight roots", status_code=403, param=param)
    return resolved


def check_adapter_dir(path_str: str, roots: list[Path], param: str = "lora_path") -> Path:
    """A PEFT adapter directory inside the weight roots."""
    path = confined_dir(path_str, roots, param)
    if not is_adapter_dir(path):
        raise RequestError(f"{param} {path_str} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}", param=param)
    return path


def published_adapter(path: Path, weight_dir: str) -> AdapterInfo:
    """The adapter a trainer-published ``weights/step_N`` holds (STABLE and named by ``prime_adapter.json``)."""
    if not is_stable(path):
        raise RequestError(
            f"weight_dir {weight_dir} has no STABLE marker (incomplete or not written by the trainer)",
            status_code=409,
            param="weight_dir",
        )
    try:
        info = AdapterInfo.read(path)
    except ValueError as e:
        raise RequestError(f"{path / ADAPTER_INFO} is invalid: {e}", param="weight_dir") from e
    if info is None:
        raise RequestError(
            f"weight_dir {weight_dir} holds a LoRA adapter without {ADAPTER_INFO} naming it: "
            "load it with POST /v1/load_lora_adapter {lora_name, lora_path}",
            param="weight_dir",
        )
    return info
