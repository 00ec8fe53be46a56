"""Image inputs of a request: decoded once by the server, then consumed by either engine.

The server expands each image to its placeholder tokens (``<|vision_start|>``, N x ``<|image_pad|>``,
``<|vision_end|>``) in the prompt token ids it returns, so clients (the orchestrator) see the exact sequence the
trainer will train on. The torch engine runs the vision tower on ``pixel_values``; the vLLM engine passes the decoded
images as ``multi_modal_data`` with the placeholder runs collapsed to one token each (vLLM expands them itself with
the model's processor, which computes the same grids).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from prime_core.vision import VisionSpec, mrope_positions, to_rgb

from prime_inference.protocol import RequestError

MAX_IMAGE_PIXELS = 32_000_000
"""Largest decoded image (width x height) a request may send, checked from the image's header before it is decoded.
Pillow's own bound (179M pixels, a 500 MB RGB decode that a 200 kB PNG can ask for) lets a few requests exhaust the
host; a 32M-pixel photo decodes to about 100 MB, and the processor resizes every image far below it anyway."""
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS
"""Decoded pixels of all the images of one request together (each image stays decoded until the request ends):
four 31M-pixel images took 2.5 s and 1.2 GB to decode."""
MAX_IMAGES = 999
"""Images of one request: vLLM's default ``--limit-mm-per-prompt`` (999 per modality). 20,000 tiny images took 12 s and
1 GB to decode before their placeholders were even counted."""
_decoding = asyncio.Semaphore(1)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The formats Pillow may open for a request: not every plugin it has (EPS would run Ghostscript on client data)."""
_DATA_URL = re.compile(r"^data:([^;,]*)(?:;[^,]*)?,(.*)$", re.DOTALL)


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
    if len(sources) > MAX_IMAGES:
        raise RequestError(f"{len(sources)} images in one request; at most {MAX_IMAGES} are allowed", param=param)
    opened = [_open_image(s, i, param) for i, s in enumerate(sources)]
    total = sum(image.width * image.height for image in opened)
    if total > MAX_REQUEST_PIXELS:
        raise RequestError(
            f"the images hold {total} pixels together, more than the {MAX_REQUEST_PIXELS} a request may send",
            param=param,
        )
    images = []
    for i, image in enumerate(opened):
        try:
            image.load()
            images.append(to_rgb(image))
        except (ValueError, OSError) as e:  # a header that decodes but a truncated or corrupt body
            raise RequestError(f"image {i} does not decode: {e}", param=param) from e
    pixel_values, grids = vision.processor.process_many(images)
    return MultiModalInput(images, pixel_values, grids, vision.image_token_id)


async def decode_images_off_loop(sources: list[Any], vision: VisionSpec | None, param: str) -> MultiModalInput:
    """`decode_images` in a worker thread (Pillow releases the GIL while it decodes), one request at a time: the
    event loop keeps serving every other client meanwhile, and concurrent requests do not multiply the memory."""
    async with _decoding:
        return await asyncio.to_thread(decode_images, sources, vision, param)


def _open_image(source: Any, index: int, param: str) -> Any:
    """Image ``index`` of a request opened from its header only (size known, pixels not decoded). Only inline images
    are taken: a local path or ``file://`` URL would let any client read the host's files (vLLM reads none unless
    ``--allowed-local-media-path`` allows them), and this server fetches no remote URL."""
    import PIL.Image

    if not isinstance(source, str):
        raise RequestError(f"image {index} must be a data: URL or base64 text", param=param)
    payload, mime = source, None
    if (m := _DATA_URL.match(source)) is not None:
        mime, payload = m.group(1), m.group(2)
        if not mime.startswith("image/") or ";base64," not in source[: m.start(2)]:
            raise RequestError(
                f"image {index} is a data: URL of {mime or 'no type'}, not base64 image data", param=param
            )
    elif source.startswith(("http://", "https://")):
        raise RequestError(f"image {index}: remote image URLs are not fetched; send a data: URL", param=param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        local = mime is None and source.startswith(("file:", "/", "~", "."))
        what = "a local path: the server reads no host files" if local else "not valid base64"
        raise RequestError(f"image {index} is {what}; send a data: URL", param=param) from None
    try:
        with warnings.catch_warnings():  # sizes past Pillow's warning are refused below, in one line
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except PIL.Image.DecompressionBombError as e:
        raise RequestError(f"image {index} has more than {MAX_IMAGE_PIXELS} pixels: {e}", param=param) from e
    except (OSError, ValueError) as e:
        raise RequestError(f"image {index} is not a {', '.join(IMAGE_FORMATS)} image", param=param) from e
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise RequestError(
            f"image {index} is {image.width}x{image.height} pixels, more than the {MAX_IMAGE_PIXELS} an image may have",
            param=param,
        )
    return image


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
