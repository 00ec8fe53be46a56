"""Fused log-prob head: exact against the naive computation, and measurably lighter on memory."""

from __future__ import annotations

import pytest
import torch
from prime_models import fused_logprobs
from torch.profiler import ProfilerActivity, profile


def _naive(hidden, weight, targets, temperature=1.0):
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(n, v, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [7, 64])
def test_fused_logprobs_match_naive(temperature, chunk_size):
    hidden, weight, targets = _inputs(50, 300, 16)
    lp, ent = fused_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (50,)
    # Arbitrary upstream gradients on both outputs exercise both terms of the backward.
    g1, g2 = torch.randn(50), torch.randn(50)
    gh, gw = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (hidden, weight))

    ref_lp, ref_ent = _naive(hidden, weight, targets, temperature)
    rh, rw = torch.autograd.grad((ref_lp * g1).sum() + (ref_ent * g2).sum(), (hidden, weight))
    diffs = [(a - b).abs().max().item() for a, b in ((lp, ref_lp), (ent, ref_ent), (gh, rh), (gw, rw))]
    print(f"T={temperature} chunk={chunk_size}: max diffs logprob/entropy/dhidden/dweight = {diffs}")
    assert max(diffs) < 1e-5


def test_fused_logprobs_without_entropy_and_batched_shapes():
    hidden, weight, targets = _inputs(24, 100, 8)
    lp, ent = fused_logprobs(hidden.view(2, 12, 8), weight, targets.view(2, 12), return_entropy=False, chunk_size=5)
    assert ent is None and lp.shape == (2, 12)
    lp.sum().backward()
    ref_lp, _ = _naive(hidden.detach().requires_grad_(), weight, targets)
    assert (lp.flatten() - ref_lp).abs().max() < 1e-5
    with pytest.raises(ValueError):
        fused_logprobs(hidden, weight, targets, temperature=0.0)


def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU allocator bytes while `fn` runs, from the profiler's allocation/free events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_fused_head_peak_memory_vs_naive():
    n, v, h = 8192, 32768, 64
    hidden, weight, targets = _inputs(n, v, h)

    def naive():
        logp = torch.log_softmax(hidden @ weight.T, dim=-1)
        logp.gather(-1, targets[:, None]).sum().backward()

    def fused():
        fused_logprobs(hidden, weight, targets, chunk_size=512, return_entropy=False)[0].sum().backward()

    naive_peak = _peak_cpu_bytes(naive)
    fused_peak = _peak_cpu_bytes(fused)
    print(f"peak CPU memory at N={n}, V={v}: naive {naive_peak / 2**20:.0f} MiB, fused {fused_peak / 2**20:.0f} MiB")
    assert naive_peak >= 4 * fused_peak
