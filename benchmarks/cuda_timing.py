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


def kernel_record(benchmark: str, commit: str | None, **fields: object) -> dict:
    """A kernel benchmark's record, opening with what every record carries: the device, the commit (`--commit`, else
    this checkout's HEAD; `provenance.tree_commit`), the vocabulary (none: one kernel) and the software."""
    import platform

    import torch
    from provenance import tree_commit

    software = dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(), python=platform.python_version())
    return {"benchmark": benchmark, "device": torch.cuda.get_device_name(), "commit": tree_commit(commit),
            "vocab_size": None, "software": software, **fields}  # fmt: skip
