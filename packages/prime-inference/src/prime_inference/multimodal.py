"""Image inputs of a request: decoded once by the server, then consumed by either engine.

The server expands each image to its placeholder tokens (``<|vision_start|>``, N x ``<|image_pad|>``,
``<|vision_end|>``) in the prompt token ids it returns, so clients (the orchestrator) see the exact sequence the
trainer will train on. The torch engine runs the vision tower on ``pixel_values``; the vLLM engine passes the decoded
images as ``multi_modal_data`` with the placeholder runs collapsed to one token each (vLLM expands them itself with
the model's processor, which computes the same grids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from prime_core.vision import VisionSpec, load_image, mrope_positions, to_rgb

from prime_inference.protocol import RequestError


@dataclass
class MultiModalInput:
    """The images of one prompt, in placeholder order."""

    images: list[Any]
    """Decoded RGB PIL images (vLLM's ``multi_modal_data["image"]``)."""
    pixel_values: np.ndarray
    """``[num_patches, patch_dim]`` float32 (the torch engine's vision tower input)."""
    image_grid_thw: np.ndarray
    """``[num_images, 3]`` int64."""
    image_token_id: int
    """The placeholder token of the served model."""

    def vllm_prompt(self, prompt_ids: list[int]) -> dict[str, Any]:
        """vLLM's token prompt: one placeholder per image (vLLM's processor expands it) and the decoded images."""
        ids = [t for i, t in enumerate(prompt_ids) if t != self.image_token_id or prompt_ids[i - 1] != t or i == 0]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(self.images)}}


def decode_images(sources: list[Any], vision: VisionSpec | None, param: str) -> MultiModalInput:
    """Decode and patchify ``sources`` (data: URLs, base64); a 400 names ``param`` on bad input."""
    if vision is None:
        raise RequestError("the served model takes no images (no vision_config in its config.json)", param=param)
    try:
        images = [to_rgb(load_image(s)) for s in sources]
    except (ValueError, OSError) as e:
        raise RequestError(f"invalid image: {e}", param=param) from e
    pixel_values, grids = vision.processor.process_many(images)
    return MultiModalInput(images, pixel_values, grids, vision.image_token_id)


def check_placeholders(token_ids: list[int], mm: MultiModalInput, vision: VisionSpec, param: str) -> None:
    """Each image must have its full run of placeholder tokens in ``token_ids``, in order."""
    try:
        mrope_positions(token_ids, vision.image_token_id, mm.image_grid_thw, vision.processor.merge_size)
    except ValueError as e:
        raise RequestError(f"image placeholders do not match the images: {e}", param=param) from e


def content_part_images(parts: list[dict[str, Any]], param: str) -> list[str]:
    """The image URLs of renderers' ``content_parts`` (``{"type": "image_url", "url": ...}``), in prompt order; audio
    and video are refused (no engine here takes them)."""
    urls = []
    for part in parts:
        kind = part.get("type")
        if kind in ("image_url", "image"):
            urls.append(part.get("url"))
        elif kind in ("audio_url", "video_url", "audio", "video"):
            raise RequestError(f"{kind} content is not supported by this server", param=param)
    if any(not isinstance(u, str) or not u for u in urls):
        raise RequestError("an image content part has no url", param=param)
    return urls


def placeholder_ranges(token_ids: list[int], image_token_id: int) -> list[dict[str, int]]:
    """vLLM's ``mm_placeholders["image"]``: the offset and length of each run of placeholder tokens."""
    ranges: list[dict[str, int]] = []
    for i, t in enumerate(token_ids):
        if t != image_token_id:
            continue
        if i and token_ids[i - 1] == image_token_id:
            ranges[-1]["length"] += 1
        else:
            ranges.append({"offset": i, "length": 1})
    return ranges
