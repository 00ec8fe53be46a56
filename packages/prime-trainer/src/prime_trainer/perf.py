"""Throughput, MFU and peak memory.

MFU = flops_per_token(seq_len) * tokens/s / (peak FLOP/s of one device * world size), with
flops_per_token = 6 * active matmul params + 12 * layers * heads * head_dim * seq_len (``prime_models.flops``).
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak TFLOP/s per device, matched against torch.cuda.get_device_name() (first match wins).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB300", 2500.0),
    ("GB200", 2500.0),
    ("B300", 2250.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A6000", 155.0),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
]
UNKNOWN_GPU_TFLOPS = 312.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Peak bf16 FLOP/s of one device; None on CPU unless configured (MFU is then reported as null)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return UNKNOWN_GPU_TFLOPS * 1e12


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated since the last reset, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, world_size: int) -> float | None:
    """Model FLOPs utilization in percent, or None without a known peak."""
    if peak is None:
        return None
    return 100.0 * flops_per_token * tokens_per_s / (peak * world_size)
