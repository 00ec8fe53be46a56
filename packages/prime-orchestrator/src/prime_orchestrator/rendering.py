"""Which ``renderers`` renderer turns a model's chat into token ids.

``client.renderer`` names one (renderers' names: ``qwen3``, ``llama-3``, ``qwen3-vl``, ``default``, ...). ``auto``
detects it: a hub id renderers knows maps to its renderer; otherwise the model directory's ``config.json``
``model_type`` picks the family's renderer when the tokenizer has that family's special tokens; any other model
keeps its own chat template through ``default`` (parsing Hermes-style ``<tool_call>`` blocks when it has the token).
Whichever it is, its parse is guarded (``prime_orchestrator.guarded_renderer``): a completion its
parser cannot parse is content, never a failed rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prime_core.io import LARGE_JSON_BYTES, SMALL_JSON_BYTES, UnreadableFile, read_json

# model_type -> (renderer, special tokens its template and parsers need)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3": ("qwen3", ("<|im_start|>", "<tool_call>", "<think>")),
    "qwen3_moe": ("qwen3", ("<|im_start|>", "<tool_call>", "<think>")),
    "qwen3_vl": ("qwen3-vl", ("<|im_start|>", "<|vision_start|>", "<tool_call>")),
    "llama": ("llama-3", ("<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>", "<|eom_id|>")),
}


def _json_object(path: Path, what: str, limit: int = SMALL_JSON_BYTES) -> dict[str, Any]:
    """``what`` at ``path``, read by `read_json` (bounded, a regular file only): an object, else an `UnreadableFile`."""
    value = read_json(path, what, limit)
    if not isinstance(value, dict):
        raise UnreadableFile(f"{path}: not {what} (a JSON object)")
    return value


def _special_tokens(model_dir: Path) -> set[str]:
    tokens: set[str] = set()
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        tokens |= {t["content"] for t in _json_object(tok, "a tokenizer", LARGE_JSON_BYTES).get("added_tokens", [])}
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        decoder = _json_object(cfg, "a tokenizer config").get("added_tokens_decoder", {})
        tokens |= {t["content"] for t in decoder.values() if isinstance(t, dict) and "content" in t}
    return tokens


def detect_renderer(model: str) -> dict[str, Any]:
    """The renderer config for a hub id or a local model directory."""
    from renderers.base import MODEL_RENDERER_MAP

    if model in MODEL_RENDERER_MAP:
        return {"name": MODEL_RENDERER_MAP[model]}
    path = Path(model)
    config = path / "config.json"
    if not config.is_file():
        return {"name": "auto"}  # a hub id renderers does not list: renderers resolves it
    model_type = _json_object(config, "a model config").get("model_type", "")
    family = FAMILIES.get(model_type)
    tokens = _special_tokens(path)
    if family is not None and set(family[1]) <= tokens:
        return {"name": family[0]}
    # The tokenizer's own template; Hermes-style <tool_call> blocks (Qwen's format) are parsed when it has them.
    return {"name": "default", **({"tool_parser": "qwen3"} if "<tool_call>" in tokens else {})}


def resolve_renderer(name: str, model: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``renderers.RendererConfig`` data of ``client.renderer`` (+ ``client.renderer_args``), guarded."""
    from prime_orchestrator.guarded_renderer import guarded

    config = detect_renderer(model) if name == "auto" else {"name": name}
    return guarded({**config, **(args or {})})
