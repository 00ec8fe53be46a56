"""Host-memory offload of the attention outputs that fully checkpointed layers keep (`keep_attention`).

With `keep_attention`, a fully checkpointed decoder layer keeps its attention kernel's outputs so that backward's
recompute skips attention. For SDPA those are the output `[B, N, S, D]` and its fp32 logsumexp: at 64k tokens and
16 heads x 128 that is 256 MiB per layer, the largest thing a layer holds between its forward and its backward.
`AttentionOffload` moves exactly those tensors to host memory in between:

* Forward: right after the kernel, its floating-point outputs are copied into pinned host buffers on a side CUDA
  stream ordered after the kernel; the GPU tensors are freed once their copy is done (`record_stream`), while the
  layer's forward goes on using them.
* Backward: when a layer's recompute starts, its own outputs (unless already on the way) and those of the layer
  saved before it (the next one backward reaches) are copied back on the side stream. The recompute waits for its
  own copy only where it reaches the attention op, so the previous layer's copy overlaps this layer's recompute and
  backward, and at most two layers' outputs are on the GPU at a time.

Copies move bytes only (same shapes, strides and dtypes), so losses and gradients are bitwise those without
offload. Host buffers are pooled by shape and reused across steps; one side stream carries both directions, which
orders every reuse of a buffer after its previous copy without host synchronization. CPU tensors take the same path
with plain copies into separate host buffers (how the tests exercise it).

The hook is `torch.utils.checkpoint`'s `context_fn`: `checkpoint_contexts(ops)` returns the forward and recompute
contexts, two `TorchDispatchMode`s that play the part of `create_selective_checkpoint_contexts` with `MUST_SAVE` for
`ops` and `PREFER_RECOMPUTE` for everything else, but keep the saved outputs in host memory.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


def _offloaded(x: Any) -> bool:
    # Integer outputs (RNG seed/offset) and empty placeholders stay where they are: they are tiny.
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0


class _Call:
    """The outputs of one call of a saved op: leaves kept as they are, plus host copies of the offloaded ones."""

    def __init__(self, out: Any, offload: AttentionOffload):
        leaves, self.spec = tree_flatten(out)
        self.device: torch.device | None = None
        self.host: dict[int, torch.Tensor] = {}
        self.kept: list[Any] = []
        for i, leaf in enumerate(leaves):
            if _offloaded(leaf):
                self.device = leaf.device
                self.host[i] = offload.to_host(leaf)
                self.kept.append(None)
            else:
                self.kept.append(leaf)
        self.fetched: dict[int, torch.Tensor] | None = None
        self.ready: torch.cuda.Event | None = None

    def fetch(self, offload: AttentionOffload) -> None:
        if self.fetched is None:
            self.fetched, self.ready = offload.to_device(self.host, self.device)
            self.host = {}

    def outputs(self) -> Any:
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        leaves = [self.fetched.get(i, leaf) for i, leaf in enumerate(self.kept)]
        return tree_unflatten(leaves, self.spec)


class _SavedRegion:
    """The offloaded op outputs of one checkpointed region (one layer's forward), in call order."""

    def __init__(self, offload: AttentionOffload, previous: weakref.ref[_SavedRegion] | None):
        self.offload = offload
        self.previous = previous
        self.calls: list[_Call | None] = []
        self.consumed = 0

    def fetch(self) -> None:
        for call in self.calls[self.consumed :]:
            call.fetch(self.offload)

    def fetch_with_previous(self) -> None:
        self.fetch()
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.fetch()

    def pop(self, func) -> Any:
        if self.consumed == len(self.calls):
            raise RuntimeError(
                f"{func} ran more often in the checkpoint recompute than in forward: offloaded attention outputs "
                "can be restored once (one backward per forward)"
            )
        call = self.calls[self.consumed]
        self.calls[self.consumed] = None  # the restored tensors belong to the recompute's graph from now on
        self.consumed += 1
        call.fetch(self.offload)
        return call.outputs()

    def __del__(self) -> None:
        # A forward whose backward never ran (or stopped early): its host buffers go back to the pool.
        for call in self.calls[self.consumed :]:
            if call is not None:
                self.offload.release(call.host.values(), call.device)


class _RegionMode(TorchDispatchMode):
    """A dispatch mode over one checkpointed region's ops, `ops` being the ones whose outputs are offloaded."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Compiled regions (fused elementwise chains) hold no saved op and may run compiled under this mode.
        return True

    def __init__(self, ops: set, region: _SavedRegion):
        super().__init__()
        self.ops, self.region = ops, region


class _OffloadingMode(_RegionMode):
    """Checkpoint forward: runs every op, and sends the outputs of `ops` to host memory."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            with torch.no_grad():
                self.region.calls.append(_Call(out, self.region.offload))
        return out


class _RestoringMode(_RegionMode):
    """Checkpoint recompute: returns the restored outputs of `ops` instead of running them; runs every other op."""

    def __enter__(self):
        # The recompute starts this region's backward: its outputs must come back now, the previous region's next.
        self.region.fetch_with_previous()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            with torch.no_grad():
                return self.region.pop(func)
        return func(*args, **(kwargs or {}))


class AttentionOffload:
    """Keeps the outputs of the saved ops of checkpointed layers in host memory between forward and backward.

    One instance is shared by all the layers of a model: it owns the host buffer pool and the side stream, and
    links each layer's saved region to the one saved before it, which backward reaches next (the prefetch target).
    """

    def __init__(self) -> None:
        self._pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._latest: weakref.ref[_SavedRegion] | None = None

    def checkpoint_contexts(self, ops: set) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        """A `torch.utils.checkpoint` `context_fn` result: forward offloads the outputs of `ops`, the recompute
        restores them instead of running `ops` (and prefetches the previous region's)."""
        region = _SavedRegion(self, self._latest)
        self._latest = weakref.ref(region)
        return _OffloadingMode(ops, region), _RestoringMode(ops, region)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        # The source's own strides (when dense, else contiguous), so the round trip restores them too.
        stride = torch.empty_like(like, device="meta").stride()
        free = self._pool[(tuple(like.shape), stride, like.dtype, like.device.type)]
        if free:
            return free.pop()
        return torch.empty_strided(like.shape, stride, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)

    def release(self, buffers, source: torch.device) -> None:
        """Returns host buffers that held copies of tensors on `source` to the pool."""
        for buf in buffers:
            self._pool[(tuple(buf.shape), buf.stride(), buf.dtype, source.type)].append(buf)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._take(t)
        if not t.is_cuda:
            buf.copy_(t)
            return buf
        stream = self._side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            buf.copy_(t, non_blocking=True)
        # The GPU memory is reused only after the copy: the compute stream drops `t` when the layer is done.
        t.record_stream(stream)
        return buf

    def to_device(
        self, host: dict[int, torch.Tensor], device: torch.device | None
    ) -> tuple[dict[int, torch.Tensor], torch.cuda.Event | None]:
        out = {i: torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device) for i, b in host.items()}
        if device is None or device.type != "cuda":
            for i, buf in host.items():
                out[i].copy_(buf)
            if host:
                self.release(host.values(), device)
            return out, None
        # Allocated on the compute stream, which uses them; the side stream writes them after its pending work.
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for i, buf in host.items():
                out[i].copy_(buf, non_blocking=True)
            ready = stream.record_event()
        # Later copies into these buffers queue on the same stream, after this one.
        self.release(host.values(), device)
        return out, ready
