"""Qwen3-VL: a ViT over image patches, a patch merger into the LM's hidden size, and the Qwen3 decoder with MRoPE.

Forward (single-device code, parallelism is applied from outside):

1. `visual(pixel_values, image_grid_thw)`: Conv3d patch embedding (run as one matmul), plus a learned position table
   bilinearly resampled to each image's grid, then `depth` pre-norm ViT blocks with 2D rotary attention inside each
   image (frame). The merger fuses every `merge x merge` patch block into one LM token; the blocks listed in
   `deepstack_visual_indexes` also feed their own mergers ("DeepStack" features).
2. The LM embeds the tokens and overwrites the image placeholder tokens (`image_token_id`) with the merged features,
   in order. After decoder layer i < len(deepstack), the i-th DeepStack feature is added to the placeholder
   positions.
3. Rotary positions are 3D (`layers.mrope`): text advances all axes, image tokens take their (t, row, col) on the
   merged grid (`prime_core.vision.mrope_positions`). Packed rows restart the positions of every sample.

Our parameter names: `visual.*` (HF `model.visual.*`), `model.{embed_tokens,layers,norm}` (HF
`model.language_model.*`), `lm_head`. Keeping the decoder at `model.layers` lets every parallelize function written
for the text families (AC, FSDP) apply unchanged.

Shape legend: B batch, S sequence, H LM hidden, P patches (all images), E vision hidden, N heads, D head dim,
I images, M merged tokens (P / merge**2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from prime_core.vision import packed_mrope_positions
from torch import nn

from prime_models import kernels
from prime_models.layers import build_attention_metadata
from prime_models.layers.common import activation
from prime_models.layers.kv_cache import KVCacheStep
from prime_models.layers.mrope import MRotaryEmbedding
from prime_models.models.qwen3.modeling_qwen3 import qwen3_attention_args
from prime_models.models.transformer import CausalLM, TransformerArgs

VISION_LN_EPS = 1e-6


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_grid_indices(grid_thw_I3: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch `[P]`, in the processor's merge-block order, frames repeated."""
    rows, cols = [], []
    for t, h, w in grid_thw_I3.tolist():
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
        cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def bilinear_taps(index_P: torch.Tensor, size_P: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps and weights per position resampling a `side`-long table to `size` (align_corners=True)."""
    src = index_P.float() * (side - 1) / torch.clamp(size_P - 1, min=1).float()
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index_P.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class VisionPatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels_PC: torch.Tensor) -> torch.Tensor:
        # Kernel == stride over exactly one patch: the convolution is a matmul over the flattened patch.
        weight = self.proj.weight
        return F.linear(pixels_PC.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionRotaryEmbedding(nn.Module):
    """2D rotary: the first half of the rotated dims follows the patch row, the second half the column."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        spatial = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def reset_parameters(self) -> None:
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, rows_P: torch.Tensor, cols_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.float()
        freqs = torch.cat([rows_P[:, None].float() * inv, cols_P[:, None].float() * inv], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Bidirectional attention inside each image frame (`cu_seqlens` bounds), 2D rotary applied in fp32."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x_PE: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor, backend: str
    ):
        P = x_PE.shape[0]
        q, k, v = self.qkv(x_PE).view(P, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope[0][:, None], rope[1][:, None]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x_PE.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x_PE.dtype)
        scale = self.head_dim**-0.5
        if backend == "flash_attn" and x_PE.is_cuda:
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out = kernels.flash_attn_varlen_func()(
                q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scale, causal=False
            )
        else:
            # One SDPA per frame: no [P, P] mask, whatever the number of images.
            pieces = []
            bounds = cu_seqlens.tolist()
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
                pieces.append(F.scaled_dot_product_attention(qi, ki, vi, scale=scale).transpose(0, 1))
            out = torch.cat(pieces)
        return self.proj(out.reshape(P, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=VISION_LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=VISION_LN_EPS)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, mlp_hidden, act)

    def forward(self, x_PE, rope, cu_seqlens, backend):
        x_PE = x_PE + self.attn(self.norm1(x_PE), rope, cu_seqlens, backend)
        return x_PE + self.mlp(self.norm2(x_PE))


class PatchMerger(nn.Module):
    """LayerNorm, then fuse each merge block (`merge**2` consecutive patches) with a 2-layer GELU MLP.

    `postshuffle_norm` (the DeepStack mergers) normalizes the fused vector instead of each patch.
    """

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle_norm: bool):
        super().__init__()
        self.fused_dim = dim * merge**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.fused_dim if postshuffle_norm else dim, eps=VISION_LN_EPS)
        self.linear_fc1 = nn.Linear(self.fused_dim, self.fused_dim)
        self.linear_fc2 = nn.Linear(self.fused_dim, out_dim)

    def forward(self, x_PE: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x_PE.reshape(-1, self.fused_dim))
        else:
            x = self.norm(x_PE).reshape(-1, self.fused_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, cfg: Any, attn: str = "sdpa"):
        super().__init__()
        dim = cfg.hidden_size
        self.merge = cfg.spatial_merge_size
        self.attn_backend = attn
        self.patch_embed = VisionPatchEmbed(cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, dim)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, dim)
        self.num_grid_per_side = int(cfg.num_position_embeddings**0.5)
        rope_params = dict(getattr(cfg, "rope_parameters", None) or {})
        self.rotary_pos_emb = VisionRotaryEmbedding(dim // cfg.num_heads, float(rope_params.get("rope_theta", 10000.0)))
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg.num_heads, cfg.intermediate_size, cfg.hidden_act) for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(dim, cfg.out_hidden_size, self.merge, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(cfg.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(dim, cfg.out_hidden_size, self.merge, postshuffle_norm=True)
            for _ in self.deepstack_visual_indexes
        )

    def position_embedding(self, grid_thw_I3: torch.Tensor, rows_P: torch.Tensor, cols_P: torch.Tensor) -> torch.Tensor:
        """The learned square position table resampled (bilinear, corners aligned) to every image's grid."""
        side = self.num_grid_per_side
        counts = (grid_thw_I3[:, 0] * grid_thw_I3[:, 1] * grid_thw_I3[:, 2]).tolist()
        heights = torch.repeat_interleave(grid_thw_I3[:, 1].cpu(), torch.tensor(counts))
        widths = torch.repeat_interleave(grid_thw_I3[:, 2].cpu(), torch.tensor(counts))
        h_taps, h_w = bilinear_taps(rows_P, heights, side)
        w_taps, w_w = bilinear_taps(cols_P, widths, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4).to(self.pos_embed.weight.device)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4).to(self.pos_embed.weight.device)
        return (self.pos_embed(idx) * weights[:, :, None]).sum(1)

    def forward(
        self, pixel_values_PC: torch.Tensor, grid_thw_I3: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged image features `[M, H]` and the DeepStack features (each `[M, H]`)."""
        grid_cpu = grid_thw_I3.detach().cpu().long()
        rows, cols = vision_grid_indices(grid_cpu, self.merge)
        x = self.patch_embed(pixel_values_PC)
        x = x + self.position_embedding(grid_cpu, rows, cols).to(x.dtype)
        rope = self.rotary_pos_emb(rows.to(x.device), cols.to(x.device))
        frame_lens = torch.repeat_interleave(grid_cpu[:, 1] * grid_cpu[:, 2], grid_cpu[:, 0])
        cu_seqlens = F.pad(frame_lens.cumsum(0), (1, 0)).to(torch.int32).to(x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cu_seqlens, self.attn_backend)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


class Qwen3VLForConditionalGeneration(CausalLM):
    """`model(input_ids, position_ids, pixel_values=..., image_grid_thw=...)`; text-only calls work as for `CausalLM`.

    Multimodal inputs: `pixel_values [P, C*T*patch*patch]` of every image of the batch concatenated in the order their
    placeholder runs appear in `input_ids` (row-major), `image_grid_thw [I, 3]`, and optionally
    `mrope_position_ids [3, B, S]` (computed from `input_ids` and `position_ids` when omitted).
    """

    model_type = "qwen3_vl"

    def __init__(self, args: TransformerArgs, hf_config: Any, attn: str = "sdpa"):
        super().__init__(args, hf_config, attn)
        text_config = hf_config.get_text_config()
        self.model.rotary_emb = MRotaryEmbedding(text_config, args.head_dim)
        self.visual = VisionModel(hf_config.vision_config, attn)
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)

    @classmethod
    def args_from_config(cls, cfg: Any) -> TransformerArgs:
        text = cfg.get_text_config()
        args = qwen3_attention_args(text)
        args["tie_word_embeddings"] = bool(getattr(cfg, "tie_word_embeddings", False))
        return TransformerArgs(**args)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        std = self.args.initializer_range
        for module in self.visual.modules():
            if isinstance(module, nn.Conv3d):
                module.weight.normal_(0.0, std, generator=generator)
                module.bias.zero_()
            elif isinstance(module, nn.LayerNorm | VisionRotaryEmbedding):
                module.reset_parameters()
        # The LM's padding row was zeroed for every embedding above; the position table has no padding row.
        self.visual.pos_embed.weight.normal_(0.0, std, generator=generator)

    def freeze_vision(self) -> None:
        """Stop training the vision tower (patch embedding, ViT blocks and every merger)."""
        self.visual.requires_grad_(False)

    def mrope_position_ids(
        self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """`[3, B, S]` rotary positions; each packed sample (position_ids restarting at 0) starts at 0."""
        if image_grid_thw is None or image_grid_thw.numel() == 0:
            return position_ids_BS.unsqueeze(0).expand(3, -1, -1)
        positions = packed_mrope_positions(
            input_ids_BS.cpu().numpy(),
            position_ids_BS.cpu().numpy(),
            image_grid_thw.cpu().numpy(),
            self.image_token_id,
            self.spatial_merge_size,
        )
        return torch.from_numpy(np.ascontiguousarray(positions)).to(input_ids_BS.device)

    def forward_hidden(
        self,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mrope_position_ids: torch.Tensor | None = None,
        kv_cache: KVCacheStep | None = None,
    ) -> torch.Tensor:
        if position_ids_BS is None:
            position_ids_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(input_ids_BS)
        h = self.model.embed_tokens(input_ids_BS)
        deepstack: list[torch.Tensor] = []
        image_mask_BS = None
        if pixel_values is not None and pixel_values.numel() > 0:
            if image_grid_thw is None:
                raise ValueError("pixel_values need image_grid_thw")
            image_embeds_MH, deepstack = self.visual(pixel_values, image_grid_thw)
            image_mask_BS = input_ids_BS == self.image_token_id
            num_placeholders = int(image_mask_BS.sum())
            if num_placeholders != image_embeds_MH.shape[0]:
                raise ValueError(
                    f"{num_placeholders} image placeholder tokens but the images give {image_embeds_MH.shape[0]} "
                    "features (truncated image block, or images not matching the prompt?)"
                )
            h = h.masked_scatter(image_mask_BS.unsqueeze(-1), image_embeds_MH.to(h.dtype))
        elif torch.is_grad_enabled() and any(p.requires_grad for p in self.visual.parameters()):
            # A trainable vision tower must get a gradient on every data-parallel rank, or FSDP's reduce-scatter of
            # its parameter group would differ between a rank with images and one without: add an exact zero.
            h = h + sum(p.sum() for p in self.visual.parameters() if p.requires_grad) * 0.0
            image_grid_thw = None
        if mrope_position_ids is None:
            mrope_position_ids = self.mrope_position_ids(input_ids_BS, position_ids_BS, image_grid_thw)
        rope = self.model.rotary_emb(mrope_position_ids, h.dtype)
        meta = build_attention_metadata(position_ids_BS, self.attn_backend, kv_cache)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, meta)
            if i < len(deepstack):
                h = h.masked_scatter(image_mask_BS.unsqueeze(-1), h[image_mask_BS] + deepstack[i].to(h.dtype))
        return self.model.norm(h)
