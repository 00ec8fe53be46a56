"""Image inputs of vision-language models (Qwen3-VL): decoding, patchifying, placeholder counts and 3D positions.

Torch-free (numpy + Pillow), so the orchestrator, the inference server and the trainers share one implementation.
Pillow is imported only by the functions that decode or resize images (extra ``prime-core[vision]``).

Qwen-VL image pipeline, equal to transformers' ``Qwen2VLImageProcessorPil`` (which Qwen3-VL uses):

1. convert to RGB (transparent pixels over white), resize with bicubic filtering to the nearest size whose sides are
   multiples of ``patch_size * merge_size`` and whose area lies in ``[min_pixels, max_pixels]`` (``smart_resize``);
2. scale to [0, 1], normalize with ``image_mean`` / ``image_std``;
3. cut ``patch_size`` x ``patch_size`` patches in merge-block order (the ``merge_size`` x ``merge_size`` patches that
   the vision merger fuses into one LM token are consecutive) and repeat each patch ``temporal_patch_size`` times
   (a still image is a 2-frame video): ``pixel_values`` ``[grid_h * grid_w, C * T * P * P]``, ``grid_thw`` ``(1,
   grid_h, grid_w)``.

An image occupies ``grid_t * grid_h * grid_w / merge_size**2`` placeholder tokens (``image_token_id``) in the token
sequence, between ``<|vision_start|>`` and ``<|vision_end|>``.
"""

from __future__ import annotations

import base64
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prime_core.io import UnreadableFile, read_json

VISION_HINT = "image inputs need Pillow: pip install 'prime-core[vision]'"

IMAGE_PAD = "<|image_pad|>"

_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,(.*)$", re.DOTALL)


def _json_object(path: Path, what: str) -> dict[str, Any]:
    """``what`` at ``path``, read by `read_json` (bounded, a regular file only), which must be a JSON object."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise UnreadableFile(f"{path}: not {what} (a JSON object; this is a {type(value).__name__})")
    return value


def _pil():
    try:
        import PIL.Image
    except ImportError:
        raise ImportError(VISION_HINT) from None
    return PIL.Image


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the area in [min_pixels, max_pixels], aspect kept."""
    if min(height, width) <= 0:
        raise ValueError(f"image has an empty side ({width}x{height})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be below 200, got {max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source: Any):
    """A PIL image from a PIL image, bytes, a ``data:image/...;base64,`` URL, base64 text, a path or ``file://`` URL,
    or a ``{"bytes": ..., "path": ...}`` dict (the ``datasets`` Image feature)."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, dict):
        if source.get("bytes") is not None:
            return load_image(source["bytes"])
        if source.get("path"):
            return load_image(source["path"])
        if source.get("url"):
            return load_image(source["url"])
        raise ValueError(f"image dict needs 'bytes', 'path' or 'url', got keys {sorted(source)}")
    if isinstance(source, bytes | bytearray | memoryview):
        image = Image.open(io.BytesIO(bytes(source)))
        image.load()
        return image
    if isinstance(source, str | Path):
        text = str(source)
        m = _DATA_URL.match(text)
        if m is not None:
            return load_image(base64.b64decode(m.group(1)))
        if text.startswith(("http://", "https://")):
            raise ValueError("remote image URLs are not fetched; pass a data: URL, base64 bytes or a local path")
        path = Path(text.removeprefix("file://")).expanduser()
        if len(text) < 4096 and path.is_file():
            image = Image.open(path)
            image.load()
            return image
        try:
            return load_image(base64.b64decode(text, validate=True))
        except (ValueError, OSError):
            raise ValueError(f"not an image path, data: URL or base64 image: {text[:60]!r}") from None
    raise ValueError(f"unsupported image input of type {type(source).__name__}")


def image_to_data_url(image: Any, fmt: str = "PNG") -> str:
    """``data:image/png;base64,...`` of an image (PIL image, bytes or anything ``load_image`` reads)."""
    if isinstance(image, bytes | bytearray):
        raw = bytes(image)
        fmt = (_pil().open(io.BytesIO(raw)).format or fmt).upper()
    else:
        buf = io.BytesIO()
        load_image(image).save(buf, format=fmt)
        raw = buf.getvalue()
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(raw).decode()}"


def to_rgb(image):
    """RGB copy of a PIL image; transparent pixels are composited over white (as transformers does)."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen-VL image preprocessing parameters (``preprocessor_config.json`` of a Qwen2/2.5/3-VL model)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 64 * 64
    max_pixels: int = 16 * 16 * 4 * 16384
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], vision_config: dict[str, Any] | None = None) -> ImageProcessor:
        """From a ``preprocessor_config.json`` dict; missing patch sizes come from the model's ``vision_config``."""
        vision_config = vision_config or {}
        size = cfg.get("size") or {}
        defaults = cls()
        patch = cfg.get("patch_size") or vision_config.get("patch_size") or defaults.patch_size
        merge = cfg.get("merge_size") or vision_config.get("spatial_merge_size") or defaults.merge_size
        return cls(
            patch_size=int(patch),
            temporal_patch_size=int(
                cfg.get("temporal_patch_size")
                or vision_config.get("temporal_patch_size")
                or defaults.temporal_patch_size
            ),
            merge_size=int(merge),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or (patch * merge) ** 2),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
            image_mean=tuple(float(x) for x in cfg.get("image_mean") or defaults.image_mean),
            image_std=tuple(float(x) for x in cfg.get("image_std") or defaults.image_std),
            rescale_factor=float(cfg.get("rescale_factor") or defaults.rescale_factor),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageProcessor:
        """From ``preprocessor_config.json`` in an HF model dir, else from its ``config.json`` ``vision_config``."""
        path = Path(path)
        pre = path / "preprocessor_config.json"
        model_cfg = path / "config.json"
        vision_config = _json_object(model_cfg, "a model config").get("vision_config") if model_cfg.is_file() else None
        if not pre.is_file() and vision_config is None:
            raise ValueError(f"{path}: no preprocessor_config.json and no vision_config in config.json")
        return cls.from_dict(_json_object(pre, "a preprocessor config") if pre.is_file() else {}, vision_config)

    def to_dict(self) -> dict[str, Any]:
        """``preprocessor_config.json`` contents that transformers' Qwen2-VL image processor (and vLLM) read."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,
            "rescale_factor": self.rescale_factor,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
        }

    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """``(grid_t, grid_h, grid_w)`` of an image of ``height`` x ``width`` pixels (before resizing)."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid_thw: tuple[int, int, int] | np.ndarray) -> int:
        """Placeholder tokens of an image with this patch grid."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.merge_size**2

    def __call__(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``(pixel_values [grid_h * grid_w, C * T * P * P] float32, (1, grid_h, grid_w))`` of one image."""
        Image = _pil()
        rgb = to_rgb(load_image(image))
        height, width = rgb.height, rgb.width
        new_h, new_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        if (new_h, new_w) != (height, width):
            rgb = rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        # Same arithmetic as transformers: rescale in float64, cast to float32, then normalize in float32.
        x = (np.asarray(rgb, dtype=np.uint8).astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        x = np.moveaxis(x, -1, 0)  # [C, H, W]
        c, p, m, t = x.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = new_h // p, new_w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p), dtype=np.float32), (1, gh, gw)

    def process_many(self, images: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated ``pixel_values`` and ``image_grid_thw [N, 3]`` of several images, in order."""
        if not images:
            return np.zeros((0, 3 * self.temporal_patch_size * self.patch_size**2), np.float32), np.zeros(
                (0, 3), np.int64
            )
        out = [self(im) for im in images]
        return np.concatenate([pv for pv, _ in out]), np.asarray([g for _, g in out], np.int64)


@dataclass(frozen=True)
class VisionSpec:
    """What a client of a vision-language model needs: its image preprocessing and special token ids."""

    processor: ImageProcessor
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_model_dir(cls, path: str | Path) -> VisionSpec | None:
        """From an HF model dir (``config.json`` + optional ``preprocessor_config.json``); None for text models."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            return None
        cfg = _json_object(cfg_file, "a model config")
        if "vision_config" not in cfg or "image_token_id" not in cfg:
            return None
        return cls(
            ImageProcessor.from_model_dir(path),
            int(cfg["image_token_id"]),
            int(cfg["vision_start_token_id"]),
            int(cfg["vision_end_token_id"]),
        )

    def expand_placeholders(self, token_ids: list[int], grids: list[tuple[int, int, int]] | np.ndarray) -> list[int]:
        """Replace the k-th single ``image_token_id`` (as a chat template renders an image) with image k's
        placeholder tokens."""
        pads = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(pads) != len(grids):
            raise ValueError(f"the prompt has {len(pads)} image placeholders for {len(grids)} images")
        out, prev = [], 0
        for i, grid in zip(pads, grids, strict=True):
            out += token_ids[prev:i] + [self.image_token_id] * self.processor.num_tokens(tuple(grid))
            prev = i + 1
        return out + token_ids[prev:]

    def placeholder_ids(self, grid_thw: tuple[int, int, int]) -> list[int]:
        """``<|vision_start|>``, the image's placeholder tokens, ``<|vision_end|>``."""
        return [self.vision_start_token_id, *[self.image_token_id] * self.processor.num_tokens(grid_thw)] + [
            self.vision_end_token_id
        ]


def image_parts(content: Any) -> list[Any]:
    """The image sources of a message's content, in order: OpenAI ``{"type": "image_url", "image_url": {"url"}}``
    parts and Qwen/HF ``{"type": "image", "image": ...}`` parts (an ``image`` part without a source yields None: its
    image comes from the row's ``images`` column)."""
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "image_url":
            url = part.get("image_url")
            out.append(url.get("url") if isinstance(url, dict) else url)
        elif kind == "image":
            out.append(part.get("image") if part.get("image") is not None else part.get("url"))
    return out


def mrope_positions(
    token_ids: np.ndarray | list[int], image_token_id: int, image_grid_thw: np.ndarray | list, merge_size: int
) -> np.ndarray:
    """3D (temporal, height, width) rotary positions ``[3, L]`` of one sample, as Qwen-VL's ``get_rope_index``.

    Text tokens advance all three axes together. An image's ``t*h*w/merge**2`` placeholder tokens take
    ``(start + t, start + row, start + col)`` over the merged grid, and the text after it resumes at
    ``start + max(h, w) / merge``. Images are consumed in order; every image's placeholders must be present in full.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    out = np.empty((3, len(ids)), dtype=np.int64)
    is_image = ids == image_token_id
    pos, i, k = 0, 0, 0
    n = len(ids)
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = np.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        if k >= len(grids):
            raise ValueError(f"more image placeholder runs than images ({len(grids)}) in the sample")
        t, h, w = (int(v) for v in grids[k])
        lh, lw = h // merge_size, w // merge_size
        count = t * lh * lw
        if i + count > n or not is_image[i : i + count].all():
            raise ValueError(f"image {k} needs {count} consecutive placeholder tokens at position {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        out[0, i : i + count] = tt.reshape(-1) + pos
        out[1, i : i + count] = hh.reshape(-1) + pos
        out[2, i : i + count] = ww.reshape(-1) + pos
        pos += max(h, w) // merge_size
        i += count
        k += 1
    if k != len(grids):
        raise ValueError(f"the sample has placeholders for {k} images but {len(grids)} images were given")
    return out


def packed_mrope_positions(
    input_ids_RS: np.ndarray,
    position_ids_RS: np.ndarray,
    image_grid_thw: np.ndarray | None,
    image_token_id: int,
    merge_size: int,
) -> np.ndarray:
    """``[3, R, S]`` positions of packed rows: each sample (``position_ids`` restarting at 0) starts again at 0.

    Images of ``image_grid_thw`` belong to the placeholder runs in row-major order of ``input_ids``.
    """
    input_ids_RS = np.asarray(input_ids_RS)
    position_ids_RS = np.asarray(position_ids_RS)
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw).reshape(-1, 3)
    out = np.broadcast_to(position_ids_RS, (3, *position_ids_RS.shape)).copy()
    k = 0
    for r in range(input_ids_RS.shape[0]):
        row = input_ids_RS[r]
        if not (row == image_token_id).any():
            continue
        starts = np.flatnonzero(position_ids_RS[r] == 0).tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        for a, b in zip(starts, [*starts[1:], len(row)], strict=True):
            seg = row[a:b]
            n_img = _count_images(seg, image_token_id, grids[k:], merge_size)
            out[:, r, a:b] = mrope_positions(seg, image_token_id, grids[k : k + n_img], merge_size)
            k += n_img
    if k != len(grids):
        raise ValueError(f"rows hold placeholders for {k} images, image_grid_thw has {len(grids)}")
    return out


def _count_images(ids: np.ndarray, image_token_id: int, grids: np.ndarray, merge_size: int) -> int:
    """How many of the next ``grids`` the placeholder tokens of ``ids`` account for."""
    total = int((ids == image_token_id).sum())
    used = 0
    for n, (t, h, w) in enumerate(grids.tolist()):
        if used == total:
            return n
        used += t * h * w // merge_size**2
    if used != total:
        raise ValueError(f"{total} image placeholder tokens do not match the image grids")
    return len(grids)
