"""Model loading and the forward passes of the PyTorch engine: prefill and batched decode over a slotted KV cache.

`CachedDecoder` samples with prime_models' own forward, the trainer's: `CausalLM.forward_hidden` takes a KV cache
(`prime_models.layers.kv_cache`), each attention layer writes its new K/V there and attends over the cached prefix.
Every op is therefore the trainer's module call, and log-probs agree with the trainer's to float rounding (attention
over a cache instead of a causal square).

Vision-language models (prime_models' Qwen3-VL) prefill through the same forward with their images: image features
replace the placeholder embeddings, DeepStack features are added after the first layers, and the prompt's rotary
positions are 3D (MRoPE). Generated tokens are text, whose 3D positions are equal on all axes: plain RoPE at the
cache position plus the prompt's offset (``max 3D position + 1 - prompt length``), exactly as transformers'
``rope_deltas``.

Models prime_models does not implement (loaded with transformers) and sliding-window attention fall back to
`RecomputeDecoder`: a full forward over each running sequence per step, correct but O(n^2).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from prime_core.config import ConfigError
from prime_core.io import UnreadableFile
from torch import nn

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_causal_lm(
    path: str, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool, fallback: bool = True
) -> tuple[Any, str]:
    """Load ``path`` with prime_models (the trainer's implementation) when it supports the model, else transformers.

    ``fallback=False``: prime_models only (new weights of a model it serves). A directory it cannot read is then
    broken, and transformers would only hide why: it fills a missing tensor at random and the decoder refuses its
    model class, so the error named the class instead of the tensor.
    Returns (model in eval mode, "prime_models" | "transformers").
    """
    try:
        from prime_models import load_model
    except ImportError:
        load_model = None
    if load_model is not None:
        try:
            model = load_model(path, dtype=dtype, device=device, attn="sdpa")
            return model.eval(), "prime_models"
        except (ValueError, NotImplementedError, KeyError) as e:
            # A file that is unsafe to read, or a config too large to build, is as much so for transformers.
            if not fallback or isinstance(e, UnreadableFile | ConfigError):
                raise
            logger.info("prime_models does not load %s (%s); using transformers", path, e)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return model.to(device).eval(), "transformers"


class CachedDecoder:
    """Prefill and batched decode of a prime_models `CausalLM` over a slotted KV cache (one slot per sequence)."""

    def __init__(self, model: nn.Module, hf_config: Any, *, num_slots: int, max_len: int, device: torch.device):
        self.num_slots, self.max_len, self.device = num_slots, max_len, device
        self.set_model(model, hf_config)
        from prime_models.layers import KVCache

        args = model.args
        self.cache = KVCache(args.num_layers, args.num_kv_heads, args.head_dim, num_slots=num_slots, max_len=max_len,
                             dtype=self.dtype, device=device)  # fmt: skip
        # Per slot: rotary position minus cache position of generated tokens (non-zero after images).
        self.rope_delta: dict[int, int] = {}

    def set_model(self, model: nn.Module, hf_config: Any) -> None:
        """Point at (new) weights; cached K/V of running sequences stay as they are."""
        try:
            from prime_models import CausalLM
        except ImportError:
            raise ValueError("prime_models is not installed") from None
        if not isinstance(model, CausalLM):
            raise ValueError(f"{type(model).__name__} is not a prime_models model")
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if getattr(text_config, "use_sliding_window", False):
            raise ValueError("sliding-window attention has no cached decoder")
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype

    def release(self) -> None:
        """Drop the cache memory (call when no sequence runs)."""
        self.cache.release()

    def _logits(self, input_ids_BS: torch.Tensor, rope_positions_BS: torch.Tensor, step: Any, **images: Any):
        """fp32 logits `[B, V]` of the token after each row's last one."""
        hidden = self.model.forward_hidden(input_ids_BS, rope_positions_BS, kv_cache=step, **images)
        return self.model.lm_head(hidden[:, -1]).float()

    def _images(self, ids_1S: torch.Tensor, multimodal: Any) -> tuple[dict[str, torch.Tensor], int]:
        """The forward's image inputs of one prompt, and its rotary offset for generation."""
        model = self.model
        if not hasattr(model, "visual"):
            raise ValueError("this model takes no images")
        weight = model.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(multimodal.pixel_values).to(weight.device, weight.dtype)
        grid = torch.from_numpy(multimodal.image_grid_thw)
        positions_31S = model.mrope_position_ids(ids_1S, torch.arange(ids_1S.shape[1], device=self.device)[None], grid)
        delta = int(positions_31S.max()) + 1 - ids_1S.shape[1]
        return {"pixel_values": pixels, "image_grid_thw": grid, "mrope_position_ids": positions_31S}, delta

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], multimodal: Any = None) -> torch.Tensor:
        """Fill ``slot`` with a prompt (and its images); return fp32 logits `[V]` of the next token."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(token_ids), device=self.device)[None]
        images, self.rope_delta[slot] = {}, 0
        if multimodal is not None:
            images, self.rope_delta[slot] = self._images(ids, multimodal)
        step = self.cache.prefill(torch.tensor([slot], device=self.device), len(token_ids))
        return self._logits(ids, pos, step, **images)[0]

    @torch.inference_mode()
    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        """Give slot ``dst`` the first ``length`` cached positions of slot ``src`` (the same prompt, prefilled once)."""
        self.cache.copy_slot(src, dst, length)
        self.rope_delta[dst] = self.rope_delta.get(src, 0)

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token per running sequence at ``positions``; return fp32 logits `[B, V]`."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]
        pos_B = torch.tensor(positions, dtype=torch.long, device=self.device)
        step = self.cache.decode(torch.tensor(slots, dtype=torch.long, device=self.device), pos_B)
        deltas = [self.rope_delta.get(s, 0) for s in slots]
        rope_B = pos_B + torch.tensor(deltas, device=self.device) if any(deltas) else pos_B
        return self._logits(ids, rope_B[:, None], step)


class RecomputeDecoder:
    """Fallback without a KV cache: every step re-runs each running sequence in one padded batch."""

    def __init__(self, model: nn.Module, hf_config: Any, *, num_slots: int, max_len: int, device: torch.device):
        self.model, self.device = model, device
        self.tokens: dict[int, list[int]] = {}

    def set_model(self, model: nn.Module, hf_config: Any) -> None:
        self.model = model

    def release(self) -> None:
        self.tokens.clear()

    def _run(self, seqs: list[list[int]]) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for b, s in enumerate(seqs):  # left padding keeps every last token in the final column
            ids[b, width - len(s) :] = torch.tensor(s, device=self.device)
            mask[b, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions)
        logits = out.logits if hasattr(out, "logits") else out
        return logits[:, -1].float()

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], multimodal: Any = None) -> torch.Tensor:
        if multimodal is not None:
            raise ValueError("images need the KV-cached decoder (a prime_models vision-language model)")
        self.tokens[slot] = list(token_ids)
        return self._run([self.tokens[slot]])[0]

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        self.tokens[dst] = self.tokens[src][:length]

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        for slot, tok in zip(slots, token_ids, strict=True):
            self.tokens[slot].append(tok)
        return self._run([self.tokens[s] for s in slots])


def build_decoder(model: nn.Module, hf_config: Any, **kwargs: Any) -> CachedDecoder | RecomputeDecoder:
    """The KV-cached decoder for prime_models models, else the recompute fallback."""
    try:
        return CachedDecoder(model, hf_config, **kwargs)
    except ValueError as e:
        logger.warning("no KV-cached decoder for this model (%s): recomputing every step", e)
        return RecomputeDecoder(model, hf_config, **kwargs)
