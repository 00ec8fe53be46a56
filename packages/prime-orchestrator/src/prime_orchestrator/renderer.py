"""Client-side chat rendering for token-in generation (ChatML, as Qwen models use).

Multi-turn rollouts never re-tokenize: each turn appends the sampled tokens verbatim, then the rendered
environment messages and a fresh assistant header. Only the ``tokenizers`` library is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class ChatRenderer:
    def __init__(self, tokenizer: Any, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
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
        return cls(tok, stops)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_token_ids], skip_special_tokens=False)

    def render_message(self, message: dict[str, Any]) -> list[int]:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        return [self.im_start, *self.encode(f"{role}\n{content}"), self.im_end, *self.encode("\n")]

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        return [t for m in messages for t in self.render_message(m)]

    def generation_prompt(self) -> list[int]:
        return [self.im_start, *self.encode("assistant\n")]

    def close_turn(self, completion_ids: list[int]) -> list[int]:
        """Tokens that end an assistant turn after ``completion_ids`` (the model's own stop is kept)."""
        if completion_ids and completion_ids[-1] == self.im_end:
            return self.encode("\n")
        return [self.im_end, *self.encode("\n")]
