"""Decoder-only transformer shared by the Llama, Qwen3 and Qwen3-MoE families (single-device code).

Parameter names equal Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), and MoE experts use HF's fused
3D layout, so conversion to/from HF is a rename-free reshuffle. Parallelism (FSDP, activation checkpointing) is
applied from outside by `prime_models.parallel`.

Shape legend: B batch, S sequence, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from prime_models.fused_head import fused_logprobs
from prime_models.layers import MLP, Attention, MoE, RMSNorm, RotaryEmbedding, build_attention_metadata
from prime_models.layers.kv_cache import KVCacheStep
from prime_models.layers.moe import MoEStats


@dataclass
class TransformerArgs:
    """Architecture hyper-parameters, read from an HF config by each family's `args_from_config`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} not divisible by kv heads={self.num_kv_heads}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class DecoderLayer(nn.Module):
    def __init__(self, args: TransformerArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(
            args.hidden_size,
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm=args.qk_norm,
            norm_eps=args.rms_norm_eps,
            layer_idx=layer_idx,
        )
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer_idx):
            self.mlp = MoE(
                args.hidden_size,
                args.moe_intermediate_size,
                args.num_experts,
                args.num_experts_per_tok,
                norm_topk_prob=args.norm_topk_prob,
                act=args.hidden_act,
            )
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=args.mlp_bias)

    def forward(self, h_BSH: torch.Tensor, rope, meta) -> torch.Tensor:
        h_BSH = h_BSH + self.self_attn(self.input_layernorm(h_BSH), rope, meta)
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))


class Backbone(nn.Module):
    def __init__(self, args: TransformerArgs, hf_config: Any):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config, args.head_dim)


class CausalLM(nn.Module):
    """A causal LM: `model(input_ids, position_ids)` -> logits `[B, S, V]`.

    `position_ids` restarting at 0 inside a row mark packed samples; attention never crosses them. Passing `targets`
    returns `(logprobs, entropy)` `[B, S]` fp32 through the fused head instead of logits (use this form under FSDP,
    where the root's parameters are only gathered inside `forward`).
    """

    model_type: ClassVar[str] = ""

    def __init__(self, args: TransformerArgs, hf_config: Any, attn: str = "sdpa"):
        super().__init__()
        self.args = args
        self.config = hf_config
        self.attn_backend = attn
        self.model = Backbone(args, hf_config)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def args_from_config(cls, hf_config: Any) -> TransformerArgs:
        raise NotImplementedError

    @classmethod
    def from_config(cls, hf_config: Any, attn: str = "sdpa") -> CausalLM:
        return cls(cls.args_from_config(hf_config), hf_config, attn)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """Output projection `[V, H]`; the embedding table itself when embeddings are tied."""
        return self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF-style init: normal(0, initializer_range) for matmuls and embeddings, ones for norms."""
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
                if self.args.pad_token_id is not None and 0 <= self.args.pad_token_id < self.args.vocab_size:
                    module.weight[self.args.pad_token_id].zero_()
            elif isinstance(module, RMSNorm | RotaryEmbedding):
                module.reset_parameters()
            elif isinstance(module, MoE):
                module.gate.weight.normal_(0.0, std, generator=generator)
                module.experts.gate_up_proj.normal_(0.0, std, generator=generator)
                module.experts.down_proj.normal_(0.0, std, generator=generator)
        self.tie_weights()

    def forward_hidden(
        self,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        *,
        kv_cache: KVCacheStep | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states `[B, S, H]` (the input of the LM head).

        With `kv_cache` (sampling) every layer stores its new K/V there and attends over the cached prefix;
        `position_ids_BS` are then the new tokens' rotary positions."""
        if position_ids_BS is None:
            position_ids_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(input_ids_BS)
        h = self.model.embed_tokens(input_ids_BS)
        rope = self.model.rotary_emb(position_ids_BS, h.dtype)
        meta = build_attention_metadata(position_ids_BS, self.attn_backend, kv_cache)
        for layer in self.model.layers:
            h = layer(h, rope, meta)
        return self.model.norm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        return_entropy: bool = True,
        head_positions: torch.Tensor | None = None,
        **model_inputs: torch.Tensor | None,
    ):
        # model_inputs: a family's further inputs for forward_hidden (Qwen3-VL: pixel_values, image_grid_thw,
        # mrope_position_ids); text models take none. head_positions: distinct flat indices into the [B * S]
        # positions where the log-probs (and entropies) are wanted, 0 elsewhere: a loss that reads its loss tokens
        # alone need not pay the head (a quarter of a 0.6B model's forward) on prompts and padding.
        hidden = self.forward_hidden(input_ids, position_ids, **model_inputs)
        if targets is None:
            return self.lm_head(hidden)
        B, S, H = hidden.shape
        hidden_NH, targets_N = hidden.reshape(B * S, H), targets.reshape(B * S)
        if head_positions is not None:
            hidden_NH, targets_N = hidden_NH.index_select(0, head_positions), targets_N.index_select(0, head_positions)
        logprobs, entropy = fused_logprobs(
            hidden_NH,
            self.lm_head_weight,
            targets_N,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=return_entropy,
        )
        if head_positions is not None:
            logprobs = logprobs.new_zeros(B * S).index_copy(0, head_positions, logprobs)
            entropy = None if entropy is None else entropy.new_zeros(B * S).index_copy(0, head_positions, entropy)
        return logprobs.view(B, S), (entropy.view(B, S) if entropy is not None else None)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def router_stats(self) -> list[MoEStats]:
        """Per MoE layer statistics of the last forward (tokens per expert, balance loss); empty for dense models."""
        return [m.last_stats for m in self.moe_layers() if m.last_stats is not None]

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Mean over MoE layers of the load-balancing loss of the last forward, unscaled.

        Multiply by `args.router_aux_loss_coef` (or your own coefficient) and add to the training loss.
        """
        stats = self.router_stats()
        if not stats:
            return None
        return torch.stack([s.aux_loss for s in stats]).mean()
