"""Checks on a ``weight_dir`` before any engine reads it: confined to the configured roots, STABLE, HF-shaped."""

from __future__ import annotations

from pathlib import Path

from prime_core.io import is_stable
from prime_core.schemas.weights import BROADCAST_FILE, BroadcastManifest

from prime_inference.protocol import RequestError


def check_weight_dir(weight_dir: str, roots: list[Path], source: str = "auto") -> tuple[Path, BroadcastManifest | None]:
    """Resolve ``weight_dir`` (symlinks included) and refuse what the server must not load.

    Returns the directory and, when the update comes by broadcast (``broadcast.json`` there and ``source`` is not
    "filesystem"), its manifest.
    """
    if not weight_dir or "\x00" in weight_dir:
        raise RequestError("weight_dir must be a non-empty path", param="weight_dir")
    path = Path(weight_dir).expanduser()
    if not path.is_absolute():
        raise RequestError("weight_dir must be an absolute path", param="weight_dir")
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError) as e:
        raise RequestError(f"weight_dir cannot be resolved: {e}", param="weight_dir") from e
    if roots:
        allowed = [Path(r).expanduser().resolve() for r in roots]
        if not any(resolved == r or resolved.is_relative_to(r) for r in allowed):
            raise RequestError("weight_dir is outside the server's weight roots", status_code=403, param="weight_dir")
    if not resolved.is_dir():
        raise RequestError(f"weight_dir {weight_dir} is not a directory", param="weight_dir")
    if not is_stable(resolved):
        raise RequestError(
            f"weight_dir {weight_dir} has no STABLE marker (incomplete or not written by the trainer)",
            status_code=409,
            param="weight_dir",
        )
    manifest_file = resolved / BROADCAST_FILE
    if source != "filesystem" and manifest_file.is_file():
        try:
            return resolved, BroadcastManifest.model_validate_json(manifest_file.read_text())
        except ValueError as e:
            raise RequestError(f"{manifest_file} is not a valid broadcast manifest: {e}", param="weight_dir") from e
    if source == "broadcast":
        raise RequestError(f"weight_dir {weight_dir} announces no broadcast ({BROADCAST_FILE})", param="weight_dir")
    if not (resolved / "config.json").is_file() or not any(resolved.glob("*.safetensors")):
        raise RequestError(f"weight_dir {weight_dir} holds no config.json and *.safetensors", param="weight_dir")
    return resolved, None
