"""Activation checkpointing chosen from the micro-batch's size and the free GPU memory (``parallel.ac = "auto"``).

`choose_plan` is pure arithmetic: given the decoder's shape, one micro-batch's tokens and the bytes left for
activations, it returns the fastest of the measured plans whose estimate fits, in this order (benchmarks on one
H100, Qwen3-0.6B shape, docs/benchmarks.md):

1. no checkpointing (no recompute);
2. full checkpointing keeping every layer's attention output, in pinned host memory when the copies hide behind the
   layer's compute (long rows: 17.5k tok/s at 64k, as fast as keeping them on the GPU, in 7 GiB less);
3. the same kept on the GPU;
4. the same in host memory when the copies take at most a layer's forward (shorter rows);
5. the offload of 2 or 4 with each MLP recomputed in 8 sequence chunks (a lower backward peak at no extra compute);
6. full checkpointing keeping the attention outputs of as many of the last layers as fit;
7. full checkpointing (recomputes attention too: 14.4k tok/s at 64k);
8. full checkpointing with each MLP recomputed in 8 sequence chunks (lowest peak; the last resort).

Estimates, per token of a micro-batch on one rank, bf16 activations (h hidden, w the MLP's width, the routed width
of an MoE layer; a = heads x head_dim; L layers): a layer without checkpointing keeps 2 x (12h + 5w) bytes (1.55 MB
for Qwen3-0.6B; 1.44 measured); full checkpointing keeps each layer's input (2h), and in backward either the fused
log-prob head's buffers (an fp32 weight gradient, two [chunk, vocab]) or one recomputed layer (about three quarters
of its activations alive at once) on top; a kept attention output is 2a bytes plus its fp32 logsumexp. Against the
H100 peaks under FSDP2 these estimates are 0.5-0.8 GiB high with checkpointing and up to 0.9 GiB low without, which
the margin covers. `plan_memory` (the
trainer) gathers the facts: free device memory (or the `gpu_memory_fraction` cap), what the first optimizer step
will still allocate (AdamW's moments, the gradients), and the host's available memory for the offload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from prime_models.layers.attention import varlen_applies, varlen_takes
from prime_models.parallel import apply_activation_checkpointing, main_grad
from prime_models.parallel.mixed_precision import mixed_precision_of
from torch import nn

GIB = 1024**3
PCIE_BYTES_PER_S = 40e9
"""Host <-> device copy rate assumed for the attention offload (pinned copies over PCIe 5 x16: ~50 GB/s one way)."""
ATTENTION_FLOPS_PER_S = 600e12
"""What a layer's forward runs at, to compare its time with its copies' (cuDNN attention on an H100: 620-645)."""
MARGIN_BYTES = GIB // 2
"""Kept free beyond every estimate: allocator fragmentation, cuBLAS workspaces, compiled kernels' scratch."""
MARGIN_FRACTION = 0.05
"""Plus this share of the activation estimate."""
RECOMPUTE_ALIVE = 0.8
"""Share of a layer's activations alive while it is recomputed in backward. Fit to the one-rank path's 64k peaks on an
H200 (full checkpointing 15.18 GiB, keeping and offloading attention 15.43 GiB), which 0.55 (fit to FSDP2's growth
from 16k to 64k on an H100) put 0.2-1.1 GiB low: under a 16 GiB cap the offload plan was chosen and ran out of
memory. Below ~32k tokens the head's backward buffers are the larger term, so shorter rows plan as before."""
LAST_RESORT_MLP_CHUNKS = 8
MLP_CHUNKS_ALIVE = 0.55
"""The recomputed MLP's share that sequence chunks cut (fit on an H100: 0.36-0.60 GiB less at 64k)."""


@dataclass(frozen=True)
class ModelShape:
    """What activation memory depends on (one decoder layer's widths, the layer count, the head)."""

    hidden: int
    layers: int
    mlp_width: int
    """Dense MLP intermediate size, or an MoE layer's routed width (expert width x experts per token)."""
    attn_width: int
    """Query heads x head dim: one kept attention output per token is this many values."""
    heads: int
    vocab: int
    layer_params: int
    """Matmul parameters of one layer a token passes through (for the layer's forward time)."""
    dense_mlp: bool = True
    """False for MoE layers, which `mlp_chunks` leaves whole (no saving to count)."""

    @classmethod
    def from_args(cls, args) -> ModelShape:
        """From a `prime_models.TransformerArgs` (any decoder family)."""
        h, d = args.hidden_size, args.head_dim
        if args.num_experts:
            width = args.moe_intermediate_size * args.num_experts_per_tok
        else:
            width = args.intermediate_size
        attn = 2 * h * args.num_heads * d + 2 * h * args.num_kv_heads * d
        return cls(h, args.num_layers, width, args.num_heads * d, args.num_heads, args.vocab_size, attn + 3 * h * width,
                   dense_mlp=not args.num_experts)  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    """Activation checkpointing settings (`ParallelConfig`'s ``ac*`` fields) and what they are estimated to need."""

    ac: str = "none"
    keep_attention: int = 0
    """Layers (from the last) keeping their attention output under full checkpointing; -1 = all."""
    offload_attention: bool = False
    mlp_chunks: int = 0
    activation_bytes: int = 0
    """Estimated peak of the activations (and the head's buffers) on the GPU."""
    host_bytes: int = 0
    """Pinned host memory the offload holds."""
    budget_bytes: int | None = None
    """What was free for them; None when the plan was set by hand or nothing was measured (CPU)."""
    fits: bool = True
    """False when even the last resort's estimate exceeds the budget."""

    def describe(self) -> str:
        if self.ac == "none":
            what = "no activation checkpointing"
        elif self.ac == "selective":
            what = "selective activation checkpointing"
        else:
            what = "full activation checkpointing"
            if self.keep_attention:
                layers = "every layer" if self.keep_attention < 0 else f"the last {self.keep_attention} layers"
                where = f" in host memory ({self.host_bytes / GIB:.1f} GiB pinned)" if self.offload_attention else ""
                what += f", keeping the attention outputs of {layers}{where}"
            if self.mlp_chunks:
                what += f", MLP recomputed in {self.mlp_chunks} chunks"
        if self.budget_bytes is None:
            return what
        est = f"~{self.activation_bytes / GIB:.1f} GiB of activations, {self.budget_bytes / GIB:.1f} GiB free for them"
        return f"{what} ({est}{'' if self.fits else '; may not fit'})"


def head_bytes(shape: ModelShape, tokens: int, chunk_size: int) -> int:
    """The fused log-prob head's backward: fp32 weight gradient, bf16 logits and their gradient for one chunk, and the
    hidden states with their gradient."""
    return 4 * shape.vocab * shape.hidden + 2 * 2 * min(chunk_size, tokens) * shape.vocab + 4 * tokens * shape.hidden


def layer_bytes_per_token(shape: ModelShape) -> int:
    """What one decoder layer keeps for its backward without checkpointing, per token."""
    return 2 * (12 * shape.hidden + 5 * shape.mlp_width)


def kept_attention_bytes_per_token(shape: ModelShape) -> int:
    return 2 * shape.attn_width + 4 * shape.heads


def mask_bytes(rows: int, row_len: int, layers_alive: int) -> int:
    """SDPA over packed rows (several samples a row) builds a block-diagonal mask: fit to two H100 peaks of 16k packed
    rows, each layer whose activations are alive holds ~1.5 bytes per (query, key) pair and the attention call ~8.5
    more while it runs (12.8 vs 10.3 GiB with full checkpointing, 46.8 vs 34.1 GiB predicted without)."""
    return rows * row_len * row_len * (3 * layers_alive + 17) // 2


def activation_bytes(
    shape: ModelShape, tokens: int, plan: MemoryPlan, chunk_size: int = 1024, packed_rows: int = 0, row_len: int = 0
) -> int:
    """Estimated GPU peak of a micro-batch's activations under `plan` (see the module docstring).

    Without checkpointing every layer's activations are alive when the head's backward runs. With full checkpointing
    the kept tensors (layer inputs, kept attention outputs) are alive throughout, next to either the head's backward
    buffers (first) or one recomputed layer (then), whichever is larger. ``packed_rows`` rows of ``row_len`` tokens
    under SDPA (several samples a row) add their masks (`mask_bytes`)."""
    head = head_bytes(shape, tokens, chunk_size)
    layer = layer_bytes_per_token(shape)
    if plan.ac != "full":  # `selective` is not chosen here; counted as keeping everything (an upper bound)
        return head + tokens * shape.layers * layer + mask_bytes(packed_rows, row_len, shape.layers)
    recompute = layer * RECOMPUTE_ALIVE
    if plan.mlp_chunks and shape.dense_mlp:
        # The chunks cut the MLP's share of the recomputed layer; measured at 64k: about half of what that predicts.
        mlp = 2 * 5 * shape.mlp_width * MLP_CHUNKS_ALIVE
        recompute -= mlp * (plan.mlp_chunks - 1) / (2 * plan.mlp_chunks)
    kept_layers = shape.layers if plan.keep_attention < 0 else plan.keep_attention
    # Offloaded: the recomputed layer's restored output stands in for the attention output its share above already
    # counts; only the previous layer's, prefetched, is extra (measured at 64k on an H200: +0.25 GiB over full).
    on_gpu = min(kept_layers, 1) if plan.offload_attention else kept_layers
    kept = tokens * (shape.layers * 2 * shape.hidden + on_gpu * kept_attention_bytes_per_token(shape))
    return int(kept + max(head, tokens * recompute) + mask_bytes(packed_rows, row_len, 1))


def offload_copy_ratio(shape: ModelShape, row_len: int) -> float:
    """A kept attention output's host copy time over its layer's forward time, for rows of `row_len` tokens.

    The copy is linear in the row length, causal attention quadratic: long rows hide their copies."""
    copy_s = kept_attention_bytes_per_token(shape) / PCIE_BYTES_PER_S
    forward_flops = 2 * row_len * shape.attn_width + 2 * shape.layer_params
    return copy_s / (forward_flops / ATTENTION_FLOPS_PER_S)


def _with_estimate(
    plan: MemoryPlan, shape: ModelShape, tokens: int, budget: int, chunk: int, packed_rows: int, row_len: int
) -> MemoryPlan:
    act = activation_bytes(shape, tokens, plan, chunk, packed_rows, row_len)
    host = tokens * shape.layers * kept_attention_bytes_per_token(shape) if plan.offload_attention else 0
    fits = act * (1 + MARGIN_FRACTION) + MARGIN_BYTES <= budget
    return MemoryPlan(plan.ac, plan.keep_attention, plan.offload_attention, plan.mlp_chunks, act, host, budget, fits)


def choose_plan(
    shape: ModelShape,
    tokens: int,
    row_len: int,
    budget_bytes: int,
    host_budget_bytes: int,
    chunk_size: int = 1024,
    packed_rows: int = 0,
) -> MemoryPlan:
    """The fastest plan whose activations fit in `budget_bytes` (see the module docstring for the order).

    Args:
        shape: the decoder's widths.
        tokens: tokens of one micro-batch on this rank (rows x row length / context-parallel degree).
        row_len: tokens of one row (on this rank); attention time grows with it, host copies do not.
        budget_bytes: device memory free for activations once weights, gradients and optimizer state are counted.
        host_budget_bytes: pinned host memory the attention offload may take.
        chunk_size: the fused head's tokens per chunk (``init.logprob_chunk_size``).
        packed_rows: rows of the micro-batch holding several samples, when attention is SDPA (they need masks).
    """

    def plan(**kw) -> MemoryPlan:
        return _with_estimate(MemoryPlan(**kw), shape, tokens, budget_bytes, chunk_size, packed_rows, row_len)

    keep_all = plan(ac="full", keep_attention=-1)
    offload = plan(ac="full", keep_attention=-1, offload_attention=True)
    offload_ok = offload.fits and offload.host_bytes <= host_budget_bytes
    ratio = offload_copy_ratio(shape, row_len)
    chunked_offload = plan(ac="full", keep_attention=-1, offload_attention=True, mlp_chunks=LAST_RESORT_MLP_CHUNKS)
    ladder = [
        plan(ac="none"),
        offload if offload_ok and ratio <= 0.5 else None,
        keep_all,
        offload if offload_ok and ratio <= 1.0 else None,
        # Chunking the MLP costs no compute and lowers the backward's peak: under a 16 GiB cap a 64k row fits this
        # (15.07 GiB, 17.6k tok/s on an H200) where the offload alone ran out of memory and full recompute ran 14.6k.
        chunked_offload if offload.host_bytes <= host_budget_bytes and ratio <= 1.0 else None,
    ]
    for candidate in ladder:
        if candidate is not None and candidate.fits:
            return candidate
    full = plan(ac="full")
    spare = budget_bytes - full.activation_bytes * (1 + MARGIN_FRACTION) - MARGIN_BYTES
    per_layer = tokens * kept_attention_bytes_per_token(shape) * (1 + MARGIN_FRACTION)
    keep = min(int(spare // per_layer), shape.layers - 1) if spare > 0 else 0
    if keep > 0:
        return plan(ac="full", keep_attention=keep)
    if full.fits:
        return full
    return plan(ac="full", mlp_chunks=LAST_RESORT_MLP_CHUNKS)


def training_state_bytes(trainable_numel: int, master_bytes: int, optimizer_allocated: bool, grad_bytes: int) -> int:
    """What training adds to the weights already on the device by the backward's peak: AdamW's two moments (unless a
    resumed optimizer already holds them) and the gradients alive then (``grad_bytes`` per trainable parameter: the
    compute dtype's size on one rank, where they are cast to fp32 after the backward; fp32 shards under FSDP)."""
    moments = 0 if optimizer_allocated else 2 * master_bytes * trainable_numel
    return moments + grad_bytes * trainable_numel


def activation_budget(free_bytes: int, state_bytes: int) -> int:
    """Device memory left for a micro-batch's activations (may be negative: then only the last resort is left)."""
    return free_bytes - state_bytes


def host_budget(mem_available_bytes: int, local_ranks: int) -> int:
    """Pinned host memory one rank's offload may take: half of what the host has available, shared by its ranks."""
    return mem_available_bytes // (2 * max(local_ranks, 1))


# --- the trainer's facts (impure) ---------------------------------------------------------------------------------


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_free_bytes(device: torch.device, memory_fraction: float | None) -> int:
    """Memory this process can still allocate: the device's free memory plus its own cached blocks, within the
    `gpu_memory_fraction` cap when one is set (the cap bounds what the caching allocator reserves)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    if memory_fraction is not None:
        available = min(available, int(memory_fraction * total) - allocated)
    return available


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """`training_state_bytes` of this rank, plus under FSDP2 the bf16 parameters it gathers: two layers' at a time
    (one prefetched) and the root's own (embeddings, head) for the whole forward and backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainable)
    master = trainable[0].element_size() if trainable else 4
    mp = mixed_precision_of(model)
    # Under the one-rank mixed precision the gradients alive at the backward's peak are bf16 ones, unless fp32 ones
    # are held throughout (`MixedPrecision.accumulate_in_matmuls`), which are allocated already.
    grad = master if mp is None else 0 if mp.main_grad_of else mp.param_dtype.itemsize
    state = training_state_bytes(numel, master, bool(optimizer.state), grad)
    if isinstance(model, FSDPModule):
        layers = model.model.layers
        layer = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in layers.parameters())
        state += 2 * (2 * layer + root)
    return state


def _budgets(c) -> tuple[int, int]:
    """(device bytes for activations, pinned host bytes for the offload), the smallest over the ranks."""
    budget = activation_budget(
        _device_free_bytes(c.world.device, c.config.gpu_memory_fraction), _state_bytes(c.model, c.optimizer)
    )
    host = host_budget(_host_available_bytes(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if c.world.world_size > 1:
        t = torch.tensor([budget, host], dtype=torch.float64, device=c.world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget, host = (int(x) for x in t.tolist())
    return budget, host


def _packed(mb) -> bool:
    """Whether a row of the micro-batch holds several samples (position ids restart inside it)."""
    return bool(((mb.position_ids[:, 1:] == 0).sum(-1) > 0).any())


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the activations: the one-rank mixed precision's working copy, else the parameters'."""
    mp = mixed_precision_of(model)
    return mp.param_dtype if mp is not None else next(model.parameters()).dtype


def _packed_rows(c, micro_batches: list, rows: int) -> int:
    """Rows of a micro-batch that need attention masks: all of them when some row is packed and attention is SDPA
    with masks (not torch's varlen kernel, which serves packed bf16/fp16 rows on CUDA, CUDA graphs included)."""
    sdpa = getattr(c.model, "attn_backend", "sdpa") == "sdpa"
    masked = sdpa and not (
        varlen_applies(c.world.device) and varlen_takes(_compute_dtype(c.model), c.model.args.head_dim)
    )
    return rows if masked and any(_packed(mb) for mb in micro_batches) else 0


def plan_memory(c, micro_batches: list) -> MemoryPlan:
    """Before the first forward (``c``: `prime_trainer.common.Components`): choose the plan when ``parallel.ac`` is
    ``auto``, apply it and log it in one line; later calls return it. Every rank takes the same plan (the smallest
    budget of any rank decides)."""
    if c.memory_plan is not None or not micro_batches:
        return c.memory_plan or MemoryPlan()
    parallel = c.config.parallel
    # As packed, all-padding rows included: they stay out of this step's forwards, but a later step may fill them.
    shapes = (getattr(mb, "sent_shape", None) or tuple(mb.input_ids.shape) for mb in micro_batches)
    rows, row_len = max(shapes, key=lambda s: s[0] * s[1])
    row_len //= c.cp_size
    tokens = rows * row_len
    if parallel.ac != "auto":
        plan = MemoryPlan(
            parallel.ac, parallel.ac_keep_attention, parallel.ac_offload_attention, parallel.ac_mlp_chunks
        )
        source = f"parallel.ac = {parallel.ac}"
    elif c.world.device.type != "cuda":
        plan, source = MemoryPlan(), "parallel.ac = auto, on CPU"
    else:
        budget, host = _budgets(c)
        if parallel.cuda_graphs:
            host = 0  # no attention offload: its side-stream copies to host memory are not captured
        shape = ModelShape.from_args(c.model.args)
        chunk = c.config.init.logprob_chunk_size
        plan = choose_plan(shape, tokens, row_len, budget, host, chunk, _packed_rows(c, micro_batches, rows))
        source = "parallel.ac = auto"
        if plan.ac != "none":
            apply_activation_checkpointing(
                c.model.model.layers, plan.ac, 0, plan.keep_attention, plan.mlp_chunks, plan.offload_attention
            )
    note = _sum_gradients_in_matmuls_if_they_fit(c, plan, tokens, row_len, micro_batches)
    c.logger.info("memory: %s for %d tokens a micro-batch (%s)%s", plan.describe(), tokens, source, note)
    c.memory_plan = plan
    return plan


def _sum_gradients_in_matmuls_if_they_fit(c, plan: MemoryPlan, tokens: int, row_len: int, micro_batches: list) -> str:
    """On one GPU under the one-rank mixed precision, sum weight gradients in fp32 inside their matmuls
    (`prime_models.parallel.main_grad`: no bf16 gradient, no separate add per micro-batch) when the first step has
    several micro-batches and the plan's activations still fit beside fp32 gradients held through the whole forward
    and backward; the log line's note says which. With one micro-batch a step there is no sum to speed up, and the
    fp32 gradients would only raise the peak (64k tokens on an H100: 17.4 GiB against 15.4 GiB, same speed)."""
    mp = mixed_precision_of(c.model)
    if mp is None or c.world.device.type != "cuda" or mp.param_dtype.itemsize >= 4 or not main_grad.ALLOWED:
        return ""
    if len(micro_batches) < 2:
        return ""
    budget, _ = _budgets(c)
    trainable = sum(p.numel() for p in c.model.parameters() if p.requires_grad)
    extra = (4 - mp.param_dtype.itemsize) * trainable
    shape = ModelShape.from_args(c.model.args)
    packed_rows = _packed_rows(c, micro_batches, tokens // row_len)
    chunk = c.config.init.logprob_chunk_size
    if not _with_estimate(plan, shape, tokens, budget - extra, chunk, packed_rows, row_len).fits:
        return "; weight gradients summed after each backward (fp32 ones held throughout would not fit)"
    mp.accumulate_in_matmuls()
    return "; weight gradients summed in fp32 inside their matmuls"
