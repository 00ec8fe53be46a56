"""SFT rows with images: their sources in placeholder order, the placeholders expanded to each image's tokens (never
trained), and truncation that never cuts an image block."""

from __future__ import annotations

from typing import Any

import numpy as np
from prime_core.config import ConfigError
from prime_core.vision import VisionSpec, image_parts, load_image, mrope_positions


def row_images(row: dict[str, Any], messages: list[dict[str, Any]], index: int | str) -> list[Any]:
    """Image sources of a conversation in order; sourceless ``image`` parts take the row's ``images`` column."""
    column = list(row.get("images") or [])
    out = []
    for message in messages:
        for source in image_parts(message.get("content")):
            if source is None:
                if not column:
                    raise ConfigError(f"{_where(index)}: an image part has no source and the row's `images` ran out")
                source = column.pop(0)
            out.append(source)
    return out


def expand_images(
    ids: list[int],
    mask: list[bool],
    images: list[Any],
    vision: VisionSpec | None,
    index: int | str,
    prefix: bool = False,
) -> tuple[list[int], list[bool], np.ndarray | None]:
    """Replace each rendered ``<|image_pad|>`` with the image's placeholder tokens; returns the grids too. ``prefix``:
    ``ids`` are only the start of the conversation (``tokenize_conversation``'s ``max_tokens``), so later images
    have no placeholder yet."""
    if not images:
        return ids, mask, None
    if vision is None:
        raise ConfigError(
            f"{_where(index)} has images but the model has no vision config (vision_config in config.json)"
        )
    pads = [k for k, t in enumerate(ids) if t == vision.image_token_id]
    if prefix and len(pads) < len(images):
        images = images[: len(pads)]
    if len(pads) != len(images):
        raise ConfigError(
            f"{_where(index)}: the chat template rendered {len(pads)} image placeholders for {len(images)} images "
            "(does the template render image content parts?)"
        )
    grids = []
    out_ids, out_mask, prev = [], [], 0
    for k, source in zip(pads, images, strict=True):
        image = load_image(source)
        grid = vision.processor.grid_for_size(image.height, image.width)
        grids.append(grid)
        out_ids += ids[prev:k] + [vision.image_token_id] * vision.processor.num_tokens(grid)
        out_mask += mask[prev:k] + [False] * vision.processor.num_tokens(grid)
        prev = k + 1
    return out_ids + ids[prev:], out_mask + mask[prev:], np.asarray(grids, np.int64)


def truncate_keeping_images(ids: list[int], grids: np.ndarray | None, seq_len: int, vision: VisionSpec | None) -> int:
    """Length to keep (<= seq_len) that never cuts an image block: an image that does not fit is dropped whole
    (with its ``<|vision_start|>``), with everything after it. Returns the new length."""
    if len(ids) <= seq_len or grids is None:
        return min(len(ids), seq_len)
    k = 0
    for grid in grids.tolist():
        while ids[k] != vision.image_token_id:
            k += 1
        end = k + vision.processor.num_tokens(grid)
        if end > seq_len:
            return k - 1 if k > 0 and ids[k - 1] == vision.vision_start_token_id else k
        k = end
    return seq_len


def _where(index: int | str) -> str:
    return f"row {index}" if isinstance(index, int) else index


def with_images(sample: Any, images: list, grids: np.ndarray | None, vision: VisionSpec | None) -> Any:
    """Attach the images whose placeholder blocks survived truncation."""
    if grids is None:
        return sample
    num_kept = int((sample.input_ids == vision.image_token_id).sum())
    counts = np.cumsum([vision.processor.num_tokens(g) for g in grids])
    n = int(np.searchsorted(counts, num_kept, side="right")) if num_kept else 0
    if n:
        sample.images, sample.image_grid_thw = images[:n], grids[:n]
        sample.mrope_position_ids = mrope_positions(
            sample.input_ids, vision.image_token_id, grids[:n], vision.processor.merge_size
        )
    return sample
