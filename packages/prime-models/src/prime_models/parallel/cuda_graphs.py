"""CUDA graphs of the decoder stack on one GPU (``parallel.cuda_graphs``), applied from outside the model files.

With short rows (the RL loop's one 2048-token row a forward) the host bounds a forward/backward: Python dispatch,
autograd and ~600 kernel launches a micro-batch take 60-170 ms on an H100 against ~30 ms of GPU work (issue 43). A
CUDA graph replays the recorded kernels of the whole decoder stack at once, forward and backward.

What is graphed: a `CausalLM`'s `forward_hidden` (embeddings, rotary table, attention mask, decoder layers, final
norm), through torch's `make_graphed_callables`: a forward and a backward graph inside one autograd node, per key.
The LM head, the chunked log-probs and the loss stay eager (few ops; they read the graph's output).

* Key: the rows' shape, whether some row is packed, and for packed rows the varlen kernel's bucket. Packed rows whose
  packing the caller computed on the host (the trainer's `row_packing`) attend through torch's varlen kernel: its
  `cu_seqlens` are a graph input padded with empty samples to a power-of-two count, and its longest sample is rounded
  up to a power of two (both fixed at capture: blocks past a sample's end return at once), so a bucket (samples,
  longest) replays one graph; the loop's 2048-token rows of ~10 rollouts of ~214 tokens fall into one or two. Past
  `MAX_VARLEN_KEYS` buckets, and for packings the forward has to read itself, packed rows attend through a
  block-diagonal mask that the graph builds on the device from position_ids (a graph input), one graph for every
  packing of a shape. Unpacked rows keep the mask-free causal kernel.
* Capture is lazy, at the first forward of a key (warmup forward/backwards on a side stream whose gradients go
  through `torch.autograd.grad`, so nothing accumulates into ``.grad``), inside the model's forward once the one-rank
  mixed precision (`prime_models.parallel.mixed_precision`) swapped its working copy in: the graphs read the working
  tensors, which the refresh after an optimizer step overwrites in place, so their addresses never move. Applying
  mixed precision again makes a new working copy; the graphs are then captured anew.
* Gradients: the backward graph writes the parameters' gradients into static buffers, which AccumulateGrad may keep
  as the working tensors' ``.grad`` without a copy. The mixed-precision hooks move them into the masters' gradients
  and set ``.grad = None`` within the backward that made them, before the next replay overwrites the buffers
  (checked before every replay). Without mixed precision (bf16 masters) the next backward would overwrite an
  accumulated gradient, so `apply_cuda_graphs` requires it.
* Eager fallback, forward by forward: without autograd (inference log-probs, evaluation), in eval mode, under
  autocast, off CUDA, with a KV cache or extra inputs, under context parallelism, with another attention backend
  than SDPA (flash-attn's cu_seqlens vary per micro-batch), when the working copy is not swapped in, or while an
  earlier graphed forward still awaits its backward (a graph's activations are its static memory: one forward, then
  its backward, as the trainer runs them). A key whose capture fails is captured once more (a fresh pool, after a
  synchronize), then runs eagerly for the rest of the run with a warning: a failed capture costs speed, not the run.

Activation checkpointing and compiled layers run inside the capture (their recompute inside the backward graph);
checkpointing does not stash the CUDA RNG state while capturing (`prime_models.kernels.capturing`). Its attention
offload (side-stream copies to pinned host memory) is not supported. Memory: the graphs' pool, shared by the keys,
keeps the decoder's activations reserved between steps. Numerics: the eager forward's kernels, replayed.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from prime_models.layers import attention
from prime_models.layers.attention import CONTEXT_PARALLEL, ROW_PACKING, RowPacking, sample_starts, use_row_packing
from prime_models.models.transformer import CausalLM
from prime_models.parallel.main_grad import discarding_outside_capture
from prime_models.parallel.mixed_precision import MixedPrecision, mixed_precision_of

logger = logging.getLogger("prime.models")

DEVICE_TYPE: str = "cuda"
"""Device type whose forwards are graphed; CPU tests set ``cpu`` together with a stand-in for `make_graphed`."""
NUM_WARMUP_ITERS: int = 3
"""Eager forward/backwards before a capture (lazy initialization, cuDNN plans and compiles stay out of the graph)."""
CAPTURE_ATTEMPTS: int = 2
"""Captures of one key before its rows run eagerly for the rest of the run. On an H100, 2 of 6 runs of the GPU test
(each the first pytest run on a fresh machine) failed a capture with cuBLAS's EXECUTION_FAILED inside the backward
of compiled layers, cause not found; another attempt is cheap, and a training run should not die of it."""
MAX_VARLEN_KEYS: int = 8
"""Varlen buckets captured per run at most (each capture takes a few seconds); further buckets replay the mask."""
_NO_CU_SEQLENS = torch.empty(0, dtype=torch.int32)

VarlenBucket = tuple[int, int]
"""(samples the padded `cu_seqlens` holds, longest sample the kernel is launched for): both powers of two."""
GraphKey = tuple[tuple[int, ...], bool, VarlenBucket | None]
"""(rows' shape, some row packed, the varlen bucket of packed rows or None for the mask)."""


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def varlen_bucket(packing: RowPacking | None, shape: tuple[int, ...]) -> VarlenBucket | None:
    """The bucket of rows of ``shape`` whose host-computed ``packing`` the varlen kernel serves, else None."""
    if packing is None or packing.shape != shape or not packing.packed or not packing.cu_seqlens.numel():
        return None
    if not attention.varlen_applies(packing.cu_seqlens.device):
        return None
    return _pow2(packing.cu_seqlens.numel() - 1), min(_pow2(packing.max_seqlen), shape[1])


def padded_cu_seqlens(cu_seqlens: torch.Tensor, samples: int) -> torch.Tensor:
    """``cu_seqlens`` with empty samples appended up to ``samples`` (on its device, without reading it back)."""
    missing = samples + 1 - cu_seqlens.numel()
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(missing)]) if missing else cu_seqlens


def make_graphed(module: nn.Module, sample_args: tuple[torch.Tensor, ...], pool: Any) -> nn.Module:
    """torch's `make_graphed_callables` for one module; tests replace it to run the dispatch on a CPU."""
    return torch.cuda.make_graphed_callables(
        module, sample_args, num_warmup_iters=NUM_WARMUP_ITERS, allow_unused_input=True, pool=pool
    )


class _Stack(nn.Module):
    """One key's decoder stack as a module for `make_graphed_callables`: its parameters are the backbone's at capture
    (the working copy), its forward the model's eager `forward_hidden` on the key's attention path. Not part of the
    model's module tree (state dicts and optimizers never see it)."""

    def __init__(self, model: CausalLM, packed: bool, varlen: VarlenBucket | None):
        super().__init__()
        self.backbone = model.model
        self.model_ref = weakref.ref(model)
        self.packed, self.varlen = packed, varlen

    def forward(
        self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        model = self.model_ref()
        # The key's packing, not the first micro-batch's: the mask path reads only the flag (the mask comes from
        # position_ids), the varlen path the static cu_seqlens and the bucket's longest sample.
        if self.varlen is None:
            packing = RowPacking(tuple(input_ids_BS.shape), self.packed, _NO_CU_SEQLENS, 0)
        else:
            packing = RowPacking(tuple(input_ids_BS.shape), True, cu_seqlens, self.varlen[1])
        with use_row_packing(packing):
            return super(_CudaGraphed, model).forward_hidden(input_ids_BS, position_ids_BS)


class CudaGraphs:
    """The captured graphs of one model and their counters; see the module docstring."""

    def __init__(self) -> None:
        self.graphs: dict[GraphKey, Callable[..., torch.Tensor]] = {}
        self.mixed_precision: MixedPrecision | None = None
        """The working copy the graphs read."""
        self.pool: Any = None
        self.captures = 0
        self.replays = 0
        self.last_eager_reason: str | None = None
        """Why the last forward that did not replay ran eagerly (diagnostics)."""
        self.failed: dict[GraphKey, str] = {}
        """Keys whose every capture attempt failed, and the last error: their rows run eagerly."""
        self._awaiting: weakref.ref | None = None
        self._warned_awaiting = False

    def eager_reason(self, model: CausalLM, input_ids_BS: torch.Tensor) -> str | None:
        """Why this forward runs eagerly, or None when a graph serves it."""
        device = input_ids_BS.device.type
        mp = mixed_precision_of(model)
        reason = (
            "no autograd" if not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
            else "eval mode" if not model.training
            else f"rows on {device}" if device != DEVICE_TYPE
            else "autocast" if torch.is_autocast_enabled(device)
            else f"attention backend {model.attn_backend}" if model.attn_backend != "sdpa"
            else "context parallelism" if CONTEXT_PARALLEL.get() is not None
            else "no working copy in the modules" if mp is None or not mp.computing
            else "an earlier graphed forward awaits its backward" if self._awaiting_backward()
            else None
        )  # fmt: skip
        if reason is not None:
            self.last_eager_reason = reason
        return reason

    def _awaiting_backward(self) -> bool:
        node = self._awaiting() if self._awaiting is not None else None
        if node is not None and not self._warned_awaiting:
            logger.warning("cuda graphs: a forward ran before the backward of the previous one; running it eagerly")
            self._warned_awaiting = True
        return node is not None

    def run(
        self, model: CausalLM, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The decoder stack's output replayed from the key's graph (captured at its first forward), or None when the
        key's captures failed (the caller runs it eagerly)."""
        mp = mixed_precision_of(model)
        if mp is not self.mixed_precision:
            if self.graphs:
                logger.info("cuda graphs: a new working copy of the parameters; capturing again")
            self.graphs.clear()
            self.mixed_precision, self.pool = mp, None
            mp.accumulate_at_end = True
        if position_ids_BS is None:
            position_ids_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(input_ids_BS)
        shape = tuple(input_ids_BS.shape)
        packed = _packed(position_ids_BS)
        packing = ROW_PACKING.get()
        bucket = varlen_bucket(packing, shape) if packed else None
        if bucket is not None and (shape, True, bucket) not in self.graphs and self._varlen_keys() >= MAX_VARLEN_KEYS:
            bucket = None
        key = (shape, packed, bucket)
        args = (input_ids_BS, position_ids_BS)
        if bucket is not None:
            args += (padded_cu_seqlens(packing.cu_seqlens, bucket[0]),)
        _check_gradients_handed_over(mp)
        graphed = self.graphs.get(key)
        if graphed is None and key not in self.failed:
            graphed = self._capture(model, key, args)
        if graphed is None:
            self.last_eager_reason = f"capture failed: {self.failed[key]}"
            return None
        hidden = graphed(*args)
        self.replays += 1
        if hidden.grad_fn is not None:
            self._awaiting = weakref.ref(hidden.grad_fn)
            hidden.register_hook(self._backward_reached)
        return hidden

    def _backward_reached(self, grad: torch.Tensor) -> None:
        self._awaiting = None

    def _varlen_keys(self) -> int:
        return sum(key[2] is not None for key in (*self.graphs, *self.failed))

    def _capture(self, model: CausalLM, key: GraphKey, args: tuple[torch.Tensor, ...]) -> Callable | None:
        shape, packed, bucket = key
        how = f"packed, varlen {bucket[0]}x{bucket[1]}" if bucket else "packed, mask" if packed else "unpacked"
        rows = f"{'x'.join(map(str, shape))} ({how})"
        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            if self.pool is None and DEVICE_TYPE == "cuda":
                self.pool = torch.cuda.graph_pool_handle()
            # Clones: the graph's static inputs, overwritten by every replay (never the caller's tensors).
            sample = tuple(t.clone(memory_format=torch.contiguous_format) for t in args)
            start = time.perf_counter()
            try:
                graphed = _make_graphed_keeping_the_stream(_Stack(model, packed, bucket), sample, self.pool)
            except RuntimeError as e:  # torch.AcceleratorError is one
                message = str(e).strip()
                self.failed[key] = message.splitlines()[0][:300] if message else type(e).__name__
                logger.warning("cuda graphs: capturing rows %s failed (attempt %d of %d): %s", rows, attempt,
                               CAPTURE_ATTEMPTS, self.failed[key])  # fmt: skip
                self.pool = None  # what the failed capture left in its pool stays out of the next capture
                _settle()
                continue
            self.failed.pop(key, None)
            self.graphs[key] = graphed
            self.captures += 1
            logger.info(
                "cuda graphs: captured the decoder stack for rows %s in %.1f s", rows, time.perf_counter() - start
            )
            return graphed
        logger.warning("cuda graphs: rows %s run eagerly for the rest of the run", rows)
        return None


def _make_graphed_keeping_the_stream(module: nn.Module, sample_args: tuple[torch.Tensor, ...], pool: Any) -> nn.Module:
    # The warmup backwards' weight gradients would reach the masters' fp32 gradients (`parallel.main_grad`).
    with discarding_outside_capture():
        if DEVICE_TYPE != "cuda":
            return make_graphed(module, sample_args, pool)
        # A capture that fails in its end leaves torch's capture stream current; leaving this context restores ours.
        with torch.cuda.stream(torch.cuda.current_stream()):
            return make_graphed(module, sample_args, pool)


def _settle() -> None:
    if DEVICE_TYPE == "cuda":
        torch.cuda.synchronize()
    gc.collect()


def _packed(position_ids_BS: torch.Tensor) -> bool:
    known = ROW_PACKING.get()
    if known is not None and known.shape == tuple(position_ids_BS.shape):
        return known.packed
    return bool((sample_starts(position_ids_BS).sum(-1) > 1).any())  # a read-back, as the eager forward's


def _check_gradients_handed_over(mp: MixedPrecision) -> None:
    # A working tensor's .grad may be the backward graph's static buffer, which the replay is about to overwrite.
    if any(w.grad is not None for w in mp.working):
        raise RuntimeError(
            "cuda graphs: a working parameter still holds a gradient at a graphed forward; the mixed-precision hooks "
            "must hand every gradient to the masters in the backward that made it"
        )


class _CudaGraphed:
    """Mixed into a `CausalLM`'s class by `apply_cuda_graphs`: `forward_hidden` replays a graph where one serves."""

    def forward_hidden(
        self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, *, kv_cache=None, **inputs
    ) -> torch.Tensor:
        graphs = _APPLIED.get(self)
        if graphs is not None and kv_cache is None and not inputs and graphs.eager_reason(self, input_ids_BS) is None:
            hidden = graphs.run(self, input_ids_BS, position_ids_BS)
            if hidden is not None:
                return hidden
        return super().forward_hidden(input_ids_BS, position_ids_BS, kv_cache=kv_cache, **inputs)


@functools.cache
def _graphed_class(cls: type) -> type:
    return type(f"CudaGraphed{cls.__name__}", (_CudaGraphed, cls), {})


_APPLIED: weakref.WeakKeyDictionary[nn.Module, CudaGraphs] = weakref.WeakKeyDictionary()


def cuda_graphs_of(model: nn.Module) -> CudaGraphs | None:
    """The model's `CudaGraphs`, or None when `apply_cuda_graphs` was not applied to it."""
    return _APPLIED.get(model)


def _unsupported(model: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule

    from prime_models.lora.adapters import LoRALinear

    if not isinstance(model, CausalLM):
        return f"{type(model).__name__} is not a decoder CausalLM"
    if isinstance(model, FSDPModule):
        return "FSDP2 (one rank without FSDP only)"
    if type(model).forward_hidden not in (CausalLM.forward_hidden, _CudaGraphed.forward_hidden):
        return f"{type(model).__name__} has its own forward_hidden (vision-language inputs)"
    if getattr(model.args, "num_experts", 0):
        return "MoE layers (their routing reads token counts back to the host)"
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        return "LoRA adapters (their selection is host logic a graph would freeze)"
    if mixed_precision_of(model) is None:
        return "parameters without the one-rank mixed precision (fp32 masters under a bf16 working copy)"
    return None


def apply_cuda_graphs(model: nn.Module) -> CudaGraphs:
    """Replay ``model``'s decoder stack from CUDA graphs in its training forwards (see the module docstring), in place:
    the model's class becomes ``CudaGraphed<Class>`` (names, parameters and the module tree stay). Apply it after
    `apply_mixed_precision`; idempotent."""
    reason = _unsupported(model)
    if reason is not None:
        raise ValueError(f"cuda graphs do not serve {reason}")
    if not isinstance(model, _CudaGraphed):
        model.__class__ = _graphed_class(type(model))
    return _APPLIED.setdefault(model, CudaGraphs())
