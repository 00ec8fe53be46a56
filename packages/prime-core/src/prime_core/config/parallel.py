"""The trainer's parallel layout and memory savers (``parallel``): FSDP2 sharding, activation checkpointing and its
long-row knobs, CPU offload, and FSDP2 on one rank."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import BaseConfig


class ParallelConfig(BaseConfig):
    """FSDP2 data parallelism and memory savers."""

    dp_shard: int = Field(default=-1, ge=-1)
    """FSDP shard degree; -1 uses every rank (0 is refused). Must divide the world size (the rest replicates:
    HSDP)."""
    ac: Literal["auto", "none", "full", "selective"] = "auto"
    """Activation checkpointing: ``full`` recomputes every decoder layer in backward; ``selective`` keeps more (see
    ``ac_every``). ``auto`` chooses at the first step, from a micro-batch's tokens and the GPU memory left once
    weights, gradients and optimizer state are counted, the fastest of: none; full keeping every layer's attention
    output (on the GPU, or offloaded to host memory); full keeping as many as fit; full; full with chunked MLPs
    (`prime_trainer.memory`; the choice is logged). On CPU ``auto`` is ``none``."""
    ac_every: int = Field(default=0, ge=0)
    """Under ``ac = "selective"``: k >= 1 recomputes every k-th decoder layer fully (2 halves the kept activations);
    0 checkpoints every layer but keeps its attention and matmul outputs, recomputing only the cheap ops (norms,
    rotary embedding, activation functions)."""
    ac_keep_attention: int = Field(default=0, ge=-1)
    """Under ``ac = "full"``: this many decoder layers (counted from the last; -1 = all) keep their attention
    output instead of recomputing it (faster at long context, costs one [tokens, hidden] activation per layer)."""
    ac_mlp_chunks: int = Field(default=0, ge=0)
    """Under ``ac = "full"``: run each dense MLP in this many sequence chunks in backward, keeping only its input;
    the backward peak then holds one chunk's MLP intermediates instead of all (~1/N of them, for long rows), at no
    extra compute. 0 disables it; MoE layers ignore it."""
    ac_offload_attention: bool = False
    """Under ``ac = "full"`` with ``ac_keep_attention != 0``: hold the kept attention outputs in pinned host memory
    between forward and backward (copies on a side CUDA stream, overlapped with compute; the GPU holds at most two
    layers' worth instead of ``ac_keep_attention``). Bitwise the same results; costs PCIe traffic and host memory."""
    cpu_offload: bool = False
    """Keep FSDP parameters, gradients and optimizer state on CPU (GPU only)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each layer's forward (ZeRO-3); false keeps them (ZeRO-2, faster)."""
    fsdp_one_rank: bool = False
    """On one rank, wrap the model in FSDP2 as on several (casts and hooks every forward) instead of computing in
    bf16 on a working copy of the fp32 master weights refreshed once per optimizer step (the default, faster)."""
    compile_layers: bool = False
    """``torch.compile`` each decoder layer's forward (one graph shared by the layers; hooks, FSDP2 and activation
    checkpointing stay outside it). Cuts the host's work per forward/backward, which bounds short rows (the RL loop's
    one 2048-token row a forward); costs a compile at the first step and at each new micro-batch shape. Numerics may
    differ from eager in rounding (fused kernels). Off by default."""
    cuda_graphs: bool = False
    """Replay the decoder stack (embeddings, layers, final norm) from CUDA graphs in training forwards, one forward and
    one backward graph per micro-batch shape and packing (`prime_models.parallel.cuda_graphs`); the LM head and the
    loss stay eager. Pays where the host bounds the step: short rows, one or few a forward (the RL loop's 2048-token
    rows), on one GPU; costs a capture (three warmup forward/backwards) at the first micro-batch of each shape, and
    the graphs keep the decoder's activations reserved between steps. Same kernels, same numerics. Serves one CUDA
    rank on the bf16-over-fp32-masters path with SDPA attention: not with FSDP2 (several ranks, ``fsdp_one_rank``,
    ``cpu_offload``), context or expert parallelism, LoRA, FP8, MoE or vision-language models, flash-attn, bf16
    master weights or ``ac_offload_attention``. Off by default."""
    timeout_s: int = Field(default=3600, ge=1)
    """Timeout of collective operations, in seconds."""

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 shards over no rank: use -1 (every rank) or a divisor of the world size")
        return value

    @model_validator(mode="after")
    def _cuda_graphs_on_the_one_rank_path(self) -> ParallelConfig:
        if self.cuda_graphs:
            clash = [f for f in ("fsdp_one_rank", "cpu_offload", "ac_offload_attention") if getattr(self, f)]
            if clash:
                raise ValueError(f"cuda_graphs serves the one-rank path without FSDP2 or host copies: unset {clash[0]}")
        return self

    @model_validator(mode="after")
    def _every_needs_selective_ac(self) -> ParallelConfig:
        if self.ac_every and self.ac != "selective":
            raise ValueError(f"ac_every needs ac = 'selective' (got ac = {self.ac!r})")
        return self

    @model_validator(mode="after")
    def _kept_attention_needs_full_ac(self) -> ParallelConfig:
        if self.ac_keep_attention and self.ac != "full":
            raise ValueError(f"ac_keep_attention needs ac = 'full' (got ac = {self.ac!r})")
        return self

    @model_validator(mode="after")
    def _mlp_chunks_need_full_ac(self) -> ParallelConfig:
        if self.ac_mlp_chunks and self.ac != "full":
            raise ValueError(f"ac_mlp_chunks needs ac = 'full' (got ac = {self.ac!r})")
        return self

    @model_validator(mode="after")
    def _offload_attention_needs_kept_attention(self) -> ParallelConfig:
        if self.ac_offload_attention and (self.ac != "full" or self.ac_keep_attention == 0):
            raise ValueError(
                "ac_offload_attention needs ac = 'full' and ac_keep_attention != 0 "
                f"(got ac = {self.ac!r}, ac_keep_attention = {self.ac_keep_attention})"
            )
        return self
