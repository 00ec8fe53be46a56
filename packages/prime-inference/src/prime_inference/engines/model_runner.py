"""Model loading and the forward passes of the PyTorch engine: prefill and batched decode over a slotted KV cache.

The trainer's model (prime_models) has no KV cache, so `CachedDecoder` runs that model's own submodules
(embedding, per-layer norms, q/k/v/o projections, q/k norms, MLP or MoE block, final norm, LM head) and does only
the attention itself against the cache. Every op the trainer runs is therefore the same module call here, and
log-probs agree with the trainer's to float rounding (attention over a cache instead of a causal square).

Vision-language models (prime_models' Qwen3-VL) prefill with their vision tower: image features replace the
placeholder embeddings, DeepStack features are added after the first layers, and the prompt's rotary positions are
3D (MRoPE). Generated tokens are text, whose 3D positions are equal on all axes: plain RoPE at the cache position
plus the prompt's offset (``max 3D position + 1 - prompt length``), exactly as transformers' ``rope_deltas``.

Architectures whose layers do not have that shape (sliding windows, other attention variants) fall back to
`RecomputeDecoder`: a full forward over each running sequence per step, correct but O(n^2).

Shape legend: B batch (running sequences), S new tokens, T cached length, H hidden, N query heads, K kv heads,
D head dim, V vocab, L layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Decoder families whose layers are [norm -> attention (GQA, RoPE, optional q/k norm) -> residual -> norm -> MLP/MoE
# -> residual]. Others use the recompute fallback.
CACHED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "qwen3_vl"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_causal_lm(path: str, *, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> tuple[Any, str]:
    """Load ``path`` with prime_models (the trainer's implementation) when it supports the model, else transformers.

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
            logger.info("prime_models does not load %s (%s); using transformers", path, e)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return model.to(device).eval(), "transformers"


def _first_attr(obj: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


@dataclass
class _LayerParts:
    input_norm: nn.Module
    post_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    mlp: nn.Module


@dataclass
class DecoderParts:
    """References into a loaded model; no weights are copied."""

    embed: nn.Module
    layers: list[_LayerParts]
    norm: nn.Module
    lm_head: nn.Module | torch.Tensor
    inv_freq: torch.Tensor
    rope_scaling: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    vision: Any = None
    """A prime_models vision-language model (its ``visual`` tower, ``model.rotary_emb`` MRoPE), else None."""


def find_decoder_parts(model: nn.Module, hf_config: Any) -> DecoderParts:
    """Locate the submodules of a Llama/Qwen-shaped decoder in an HF or prime_models model. Raises ValueError."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CACHED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} has no cached decoder")
    vision = None
    if model_type == "qwen3_vl":
        if not hasattr(model, "visual") or not hasattr(model, "mrope_position_ids"):
            raise ValueError("vision-language models are cached only with the prime_models implementation")
        vision = model
        hf_config = hf_config.get_text_config()
    if getattr(hf_config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(hf_config, "sliding_window", None)
    ):
        raise ValueError("sliding-window attention has no cached decoder")
    root = model.model if isinstance(getattr(model, "model", None), nn.Module) else model
    embed = _first_attr(root, ("embed_tokens", "tok_embeddings", "embed"))
    layers = _first_attr(root, ("layers",))
    norm = _first_attr(root, ("norm", "final_norm"))
    lm_head = _first_attr(model, ("lm_head", "output")) or _first_attr(root, ("lm_head", "output"))
    rotary = _first_attr(root, ("rotary_emb", "rope", "rotary")) or _first_attr(model, ("rotary_emb", "rope"))
    if embed is None or layers is None or norm is None or rotary is None:
        raise ValueError("model lacks embed_tokens/layers/norm/rotary_emb")
    if lm_head is None:
        if not getattr(hf_config, "tie_word_embeddings", False):
            raise ValueError("model lacks lm_head")
        lm_head = embed.weight
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        raise ValueError("rotary embedding has no inv_freq buffer")
    rope_scaling = float(_first_attr(rotary, ("attention_scaling", "scaling")) or 1.0)
    parts = []
    first_attn = None
    for layer in layers:
        attn = _first_attr(layer, ("self_attn", "attn", "attention"))
        mlp = _first_attr(layer, ("mlp", "feed_forward", "moe"))
        in_norm = _first_attr(layer, ("input_layernorm", "attn_norm", "attention_norm"))
        post_norm = _first_attr(layer, ("post_attention_layernorm", "mlp_norm", "ffn_norm"))
        if attn is None or mlp is None or in_norm is None or post_norm is None:
            raise ValueError("decoder layer lacks attention/mlp/norms")
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if any(p is None for p in projs):
            raise ValueError("attention lacks q/k/v/o projections")
        first_attn = first_attn or attn
        parts.append(
            _LayerParts(in_norm, post_norm, *projs, getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), mlp)
        )
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    scale = float(_first_attr(first_attn, ("scaling", "scale")) or head_dim**-0.5)
    return DecoderParts(
        embed, parts, norm, lm_head, inv_freq, rope_scaling, num_heads, num_kv_heads, head_dim, scale, vision
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CachedDecoder:
    """Prefill and batched decode with a slotted KV cache.

    The cache holds, per layer, K and V tensors `[num_slots, K, capacity, D]`; a running sequence owns one slot.
    Capacity grows by doubling up to ``max_len`` and is released when no sequence runs, so memory follows the
    longest running sequence rather than ``num_slots * max_len``.
    """

    def __init__(self, model: nn.Module, hf_config: Any, *, num_slots: int, max_len: int, device: torch.device):
        self.num_slots, self.max_len, self.device = num_slots, max_len, device
        self.set_model(model, hf_config)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.capacity = 0
        # Per slot: rotary position minus cache position of generated tokens (non-zero after images).
        self.rope_delta: dict[int, int] = {}

    def set_model(self, model: nn.Module, hf_config: Any) -> None:
        """Point at (new) weights; cached K/V of running sequences stay as they are."""
        self.parts = find_decoder_parts(model, hf_config)
        self.dtype = self.parts.embed.weight.dtype

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = min(self.max_len, max(needed, 2 * self.capacity, 64))
        p = self.parts
        shape = (self.num_slots, p.num_kv_heads, new_cap, p.head_dim)
        old_k, old_v, old_cap = self.k, self.v, self.capacity
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in p.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in p.layers]
        for i in range(len(old_k)):
            self.k[i][:, :, :old_cap] = old_k[i]
            self.v[i][:, :, :old_cap] = old_v[i]
        self.capacity = new_cap

    def release(self) -> None:
        """Drop the cache memory (call when no sequence runs)."""
        self.k, self.v, self.capacity = [], [], 0

    def _rope(self, positions_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_BS[..., None].float() * self.parts.inv_freq.float().to(positions_BS.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.parts.rope_scaling
        return (emb.cos() * scaling).to(self.dtype).unsqueeze(2), (emb.sin() * scaling).to(self.dtype).unsqueeze(2)

    def _logits(self, h_BH: torch.Tensor) -> torch.Tensor:
        lm_head = self.parts.lm_head
        if isinstance(lm_head, torch.Tensor):
            return F.linear(h_BH, lm_head).float()
        return lm_head(h_BH).float()

    def _forward(
        self,
        input_ids_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        slots_B: torch.Tensor,
        prefill: bool,
        *,
        rope_positions_BS: torch.Tensor | None = None,
        images: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, tuple] | None = None,
    ) -> torch.Tensor:
        """Run the layers; write new K/V at ``positions``; return the last position's hidden state `[B, H]`.

        ``rope_positions`` (default ``positions``) rotate q/k; ``images`` = (merged features, DeepStack features,
        placeholder mask, (cos, sin) of the 3D positions) for a vision-language prefill.
        """
        p = self.parts
        B, S = input_ids_BS.shape
        h = p.embed(input_ids_BS)
        deepstack, image_mask = [], None
        if images is not None:
            features, deepstack, image_mask, (cos, sin) = images
            h = h.masked_scatter(image_mask.unsqueeze(-1), features.to(h.dtype))
        else:
            cos, sin = self._rope(positions_BS if rope_positions_BS is None else rope_positions_BS)
        if prefill:
            T = S
        else:
            T = int(positions_BS.max().item()) + 1
            key_pos_T = torch.arange(T, device=self.device)
            mask_B11T = (key_pos_T[None, :] <= positions_BS[:, -1:]).view(B, 1, 1, T)
        contiguous = bool((slots_B == torch.arange(B, device=slots_B.device) + slots_B[0]).all())
        rows = slice(int(slots_B[0]), int(slots_B[0]) + B) if contiguous else slots_B
        for i, layer in enumerate(p.layers):
            residual = h
            x = layer.input_norm(h)
            q = layer.q_proj(x).view(B, S, p.num_heads, p.head_dim)
            k = layer.k_proj(x).view(B, S, p.num_kv_heads, p.head_dim)
            v = layer.v_proj(x).view(B, S, p.num_kv_heads, p.head_dim)
            if layer.q_norm is not None:
                q = layer.q_norm(q)
            if layer.k_norm is not None:
                k = layer.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            q_BNSD, k_BKSD, v_BKSD = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if prefill:
                # One sequence per row, all starting at position 0: plain causal attention, then fill the cache.
                self.k[i][slots_B, :, :S] = k_BKSD
                self.v[i][slots_B, :, :S] = v_BKSD
                out = F.scaled_dot_product_attention(
                    q_BNSD, k_BKSD, v_BKSD, is_causal=True, scale=p.scale, enable_gqa=p.num_heads != p.num_kv_heads
                )
            else:
                pos_B = positions_BS[:, 0]
                self.k[i][slots_B, :, pos_B] = k_BKSD[:, :, 0]
                self.v[i][slots_B, :, pos_B] = v_BKSD[:, :, 0]
                keys = self.k[i][rows, :, :T]
                values = self.v[i][rows, :, :T]
                out = F.scaled_dot_product_attention(
                    q_BNSD, keys, values, attn_mask=mask_B11T, scale=p.scale, enable_gqa=p.num_heads != p.num_kv_heads
                )
            attn = layer.o_proj(out.transpose(1, 2).reshape(B, S, p.num_heads * p.head_dim))
            h = residual + attn
            residual = h
            mlp_out = layer.mlp(layer.post_norm(h))
            if isinstance(mlp_out, tuple):  # MoE blocks may also return router logits
                mlp_out = mlp_out[0]
            h = residual + mlp_out
            if i < len(deepstack):
                h = h.masked_scatter(image_mask.unsqueeze(-1), h[image_mask] + deepstack[i].to(h.dtype))
        return p.norm(h[:, -1])

    def _image_inputs(self, ids_1S: torch.Tensor, multimodal: Any) -> tuple[tuple, int]:
        """Vision tower outputs and 3D rotary (cos, sin) of one prompt, and its rotary offset for generation."""
        model = self.parts.vision
        if model is None:
            raise ValueError("this model takes no images")
        weight = model.visual.patch_embed.proj.weight
        pixels = torch.from_numpy(multimodal.pixel_values).to(weight.device, weight.dtype)
        grid = torch.from_numpy(multimodal.image_grid_thw)
        features, deepstack = model.visual(pixels, grid)
        mask = ids_1S == model.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(f"{int(mask.sum())} image placeholder tokens for {features.shape[0]} image features")
        positions_31S = model.mrope_position_ids(ids_1S, torch.arange(ids_1S.shape[1], device=self.device)[None], grid)
        cos, sin = model.model.rotary_emb(positions_31S, self.dtype)
        delta = int(positions_31S.max()) + 1 - ids_1S.shape[1]
        return (features, deepstack, mask, (cos.unsqueeze(2), sin.unsqueeze(2))), delta

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], multimodal: Any = None) -> torch.Tensor:
        """Fill ``slot`` with a prompt (and its images); return fp32 logits `[V]` of the next token."""
        S = len(token_ids)
        self._ensure_capacity(S + 1)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(S, device=self.device)[None]
        slots = torch.tensor([slot], device=self.device)
        images, self.rope_delta[slot] = None, 0
        if multimodal is not None:
            images, self.rope_delta[slot] = self._image_inputs(ids, multimodal)
        return self._logits(self._forward(ids, pos, slots, prefill=True, images=images))[0]

    @torch.inference_mode()
    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        """Give slot ``dst`` the first ``length`` cached positions of slot ``src`` (the same prompt, prefilled once)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
        self.rope_delta[dst] = self.rope_delta.get(src, 0)

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token per running sequence at ``positions``; return fp32 logits `[B, V]`."""
        self._ensure_capacity(max(positions) + 1)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        slots_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        rope_pos = None
        if any(self.rope_delta.get(s, 0) for s in slots):
            rope_pos = pos + torch.tensor([self.rope_delta.get(s, 0) for s in slots], device=self.device)[:, None]
        return self._logits(self._forward(ids, pos, slots_t, prefill=False, rope_positions_BS=rope_pos))


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
    try:
        return CachedDecoder(model, hf_config, **kwargs)
    except ValueError as e:
        logger.warning("no KV-cached decoder for this model (%s): recomputing every step", e)
        return RecomputeDecoder(model, hf_config, **kwargs)
