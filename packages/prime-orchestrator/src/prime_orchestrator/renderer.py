"""Client-side chat rendering for token-in generation (ChatML, as Qwen models use).

Multi-turn rollouts never re-tokenize: each turn appends the sampled tokens verbatim, then the rendered
environment messages and a fresh assistant header. Only the ``tokenizers`` library is needed.

Vision-language models: content parts of type ``image_url`` (or ``image``) render as Qwen-VL's
``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``; the image sources are collected
in order for the generate request and the trainer (``prime_core.vision``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prime_core.vision import VisionSpec, image_parts, image_to_data_url, load_image

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class ChatRenderer:
    def __init__(self, tokenizer: Any, stop_token_ids: list[int], vision: VisionSpec | None = None):
        self.tokenizer = tokenizer
        self.vision = vision
        self.im_start = tokenizer.token_to_id(IM_START)
        self.im_end = tokenizer.token_to_id(IM_END)
        if self.im_start is None or self.im_end is None:
            raise ValueError(
                f"tokenizer has no {IM_START} / {IM_END} tokens; token-in rollouts need a ChatML tokenizer"
            )
        self.stop_token_ids = sorted(set(stop_token_ids) | {self.im_end})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatRenderer:
        from tokenizers import Tokenizer

        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path / 'tokenizer.json'} not found: token-in rollouts need model.name to be a local "
                "HF-format directory with a tokenizer.json"
            )
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        stops: list[int] = []
        for cfg_name in ("generation_config.json", "config.json"):
            cfg_path = path / cfg_name
            if cfg_path.is_file():
                eos = json.loads(cfg_path.read_text()).get("eos_token_id")
                if eos is not None:
                    stops += eos if isinstance(eos, list) else [eos]
        return cls(tok, stops, VisionSpec.from_model_dir(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_token_ids], skip_special_tokens=False)

    def render_message(self, message: dict[str, Any], images: list[str] | None = None) -> list[int]:
        """Token ids of one message; its images' data: URLs are appended to ``images``."""
        role, content = message["role"], message.get("content") or ""
        if isinstance(content, list):
            return [self.im_start, *self.encode(f"{role}\n"), *self._render_parts(content, images), self.im_end,
                    *self.encode("\n")]  # fmt: skip
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        return [self.im_start, *self.encode(f"{role}\n{content}"), self.im_end, *self.encode("\n")]

    def _render_parts(self, parts: list[Any], images: list[str] | None) -> list[int]:
        ids: list[int] = []
        for part in parts:
            if isinstance(part, dict) and part.get("type") == "text":
                ids += self.encode(part.get("text") or "")
            elif image_parts([part]):
                if self.vision is None:
                    raise ValueError("the prompt has an image but the model has no vision config (vision_config)")
                source = image_parts([part])[0]
                image = load_image(source)
                ids += self.vision.placeholder_ids(self.vision.processor.grid_for_size(image.height, image.width))
                if images is not None:
                    images.append(
                        source if isinstance(source, str) and source.startswith("data:") else image_to_data_url(image)
                    )
        return ids

    def render(self, messages: list[dict[str, Any]], images: list[str] | None = None) -> list[int]:
        return [t for m in messages for t in self.render_message(m, images)]

    def generation_prompt(self) -> list[int]:
        return [self.im_start, *self.encode("assistant\n")]

    def close_turn(self, completion_ids: list[int]) -> list[int]:
        """Tokens that end an assistant turn after ``completion_ids`` (the model's own stop is kept)."""
        if completion_ids and completion_ids[-1] == self.im_end:
            return self.encode("\n")
        return [self.im_end, *self.encode("\n")]
