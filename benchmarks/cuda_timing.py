"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

from collections.abc import Callable


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` back-to-back calls on the current stream, after one warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
