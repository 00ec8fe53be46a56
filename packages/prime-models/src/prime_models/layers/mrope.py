"""Multimodal rotary embedding (MRoPE) of Qwen-VL language models.

Each token has three positions (temporal, height, width). Text tokens carry the same value on all three axes, which
makes MRoPE equal to plain 1D RoPE on text. The rotary frequencies are split between the axes by `mrope_section`
(`[t, h, w]`, summing to head_dim / 2); Qwen3-VL interleaves them (frequency i belongs to h when i % 3 == 1 and
i < 3 * h, to w when i % 3 == 2 and i < 3 * w, else to t), Qwen2/2.5-VL uses contiguous chunks.

Shape legend: B batch, S sequence, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from prime_models.layers.common import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """`forward(position_ids [3, B, S] or [B, S])` -> (cos, sin) `[B, S, D]`, the format `Attention` consumes."""

    def __init__(self, hf_text_config: Any, head_dim: int):
        super().__init__(hf_text_config, head_dim)
        params = dict(getattr(hf_text_config, "rope_parameters", None) or {})
        self.mrope_section = list(params.get("mrope_section") or [24, 20, 20])
        self.interleaved = bool(params.get("mrope_interleaved", True))
        if sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")

    def _combine(self, freqs_3BSF: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            out = freqs_3BSF[0].clone()
            for axis in (1, 2):
                idx = slice(axis, self.mrope_section[axis] * 3, 3)
                out[..., idx] = freqs_3BSF[axis, ..., idx]
            return out
        chunks = freqs_3BSF.split(self.mrope_section, dim=-1)
        return torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.ndim == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        freqs = self._combine(freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
