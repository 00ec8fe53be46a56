"""Fused LM head + log-softmax + gather (+ entropy) that never materializes the full `[N, V]` fp32 logits.

The forward walks over token chunks, computing `[chunk, V]` logits, their logsumexp, the target log-prob and the
entropy, and keeps only the per-token logsumexp. The backward recomputes each chunk's logits and forms the gradient
in place, so peak extra memory is about two `[chunk_size, V]` fp32 buffers plus the fp32 weight-gradient accumulator.

Gradients, with z = h @ W.T / T, p = softmax(z):
  d logprob / dz = onehot(target) - p
  d entropy / dz = -p * (z - sum(p * z))

On CUDA the per-chunk math after the matmul (logsumexp, target gather, entropy; the softmax gradient) runs as
`torch.compile`d kernels that read the matmul's own (bf16) output and write only per-token values or the bf16 logit
gradient: no `[chunk, V]` fp32 buffer is ever materialized. The values are the same function of the same bf16 logits
(up to reduction order). CPU (and `COMPILE_ON_CUDA = False`) runs the eager loop below.
"""

from __future__ import annotations

import logging

import torch

from prime_models import kernels

logger = logging.getLogger("prime.models")

COMPILE_ON_CUDA: bool = True
_compiled: dict[str, object] = {}


def _chunk_stats(z_lo: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """(lse, logprob of target, entropy or None) of one chunk's logits, computed in fp32 from `z_lo`."""
    z = z_lo.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = lse - ((z - lse[:, None]).exp() * z).sum(-1) if with_entropy else None
    return lse, logprobs, entropy


def _chunk_grad(z_lo, lse, targets, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """Gradient w.r.t. one chunk's logits, in `z_lo`'s dtype (same formula as the eager backward)."""
    z = z_lo.float()
    if temperature != 1.0:
        z = z / temperature
    p = (z - lse[:, None]).exp()
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    grad = torch.where(onehot, g_lp[:, None], 0.0) - p * g_lp[:, None]
    if g_ent is not None:
        grad = grad - (z - (p * z).sum(-1, keepdim=True)) * p * g_ent[:, None]
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(z_lo.dtype)


def _use_compiled(t: torch.Tensor) -> bool:
    return COMPILE_ON_CUDA and t.is_cuda


def _call_compiled(name: str, fn, *args):
    global COMPILE_ON_CUDA
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=False)
    try:
        return _compiled[name](*args)
    except Exception as e:  # no working triton/inductor here: fall back to the eager path for good
        logger.warning("fused log-prob head: torch.compile failed (%s); using the eager path", e)
        COMPILE_ON_CUDA = False
        return fn(*args)


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (h_CH @ w_VH.T).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, chunk_size, return_entropy):
        # Unused outputs then get None gradients, so an unused entropy costs nothing in backward.
        ctx.set_materialize_grads(False)
        n = hidden_NH.shape[0]
        logprobs = hidden_NH.new_empty(n, dtype=torch.float32)
        lse_N = hidden_NH.new_empty(n, dtype=torch.float32)
        entropy = hidden_NH.new_empty(n, dtype=torch.float32) if return_entropy else None
        compiled = _use_compiled(hidden_NH)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            if compiled:
                lse, lp, ent = _call_compiled(
                    "stats", _chunk_stats, hidden_NH[s:e] @ weight_VH.T, targets_N[s:e], temperature, return_entropy
                )
                lse_N[s:e], logprobs[s:e] = lse, lp
                if return_entropy:
                    entropy[s:e] = ent
                continue
            z = _chunk_logits(hidden_NH[s:e], weight_VH, temperature)
            lse = torch.logsumexp(z, dim=-1)
            lse_N[s:e] = lse
            logprobs[s:e] = z.gather(1, targets_N[s:e, None]).squeeze(1) - lse
            if return_entropy:
                # H = lse - sum(p * z); reuse the logits buffer for p * z to keep one [chunk, V] alive.
                p = (z - lse[:, None]).exp_()
                entropy[s:e] = lse - p.mul_(z).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        # The one-rank mixed precision's fp32 gradient of the weight's master (`prime_models.parallel.main_grad`):
        # the weight gradient is summed into it chunk by chunk and autograd gets none.
        ctx.main_grad = getattr(weight_VH, "main_grad", None)
        if entropy is None:
            return logprobs
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, targets, lse_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        into_main = need_w and ctx.main_grad is not None
        grad_w = None
        if need_w:
            grad_w = ctx.main_grad if into_main else weight.new_zeros(weight.shape, dtype=torch.float32)
        compiled = _use_compiled(hidden)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            if compiled:
                g_lp = grad_logprobs[s:e] if grad_logprobs is not None else hidden.new_zeros(e - s, dtype=torch.float32)
                g_ent = grad_entropy[s:e] if grad_entropy is not None else None
                grad_z = _call_compiled(
                    "grad", _chunk_grad, hidden[s:e] @ weight.T, lse_N[s:e], targets[s:e], g_lp, g_ent, temperature
                ).to(hidden.dtype)
                if need_h:
                    grad_h[s:e] = grad_z @ weight
                if need_w:
                    kernels.accumulate_matmul(grad_w, grad_z.T, hidden[s:e])
                continue
            z = _chunk_logits(hidden[s:e], weight, temperature)
            p = (z - lse_N[s:e, None]).exp_()
            if grad_entropy is not None:
                expected_z = (p * z).sum(-1, keepdim=True)
                # z becomes the entropy term: g_ent * p * (z - E_p[z]).
                z.sub_(expected_z).mul_(p).mul_(grad_entropy[s:e, None])
            else:
                z = None
            g_lp = grad_logprobs[s:e] if grad_logprobs is not None else torch.zeros(e - s, device=p.device)
            grad_z = p.mul_(-g_lp[:, None])
            grad_z.scatter_add_(1, targets[s:e, None], g_lp[:, None].float())
            if z is not None:
                grad_z.sub_(z)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(hidden.dtype)
            if need_h:
                grad_h[s:e] = grad_z @ weight
            if need_w:
                kernels.accumulate_matmul(grad_w, grad_z.T, hidden[s:e])
        grad_weight = grad_w.to(weight.dtype) if need_w and not into_main else None
        return grad_h, grad_weight, None, None, None, None


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` under `softmax(hidden @ weight.T / temperature)` and the distribution's entropy.

    Args:
        hidden: `[N, H]` (or `[..., H]`) final hidden states.
        weight: `[V, H]` output projection.
        targets: `[N]` (or `[...]`) int64 token ids.
        temperature: logits are divided by it (sampling temperature used by the inference engine).
        chunk_size: tokens per chunk; peak memory grows with `chunk_size * V`.
        return_entropy: also compute the entropy (else None is returned in its place).

    Returns:
        `(logprobs, entropy)`, fp32, shaped like `targets`. Both are differentiable w.r.t. hidden and weight.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden dim {hidden.shape[-1]} != weight dim {weight.shape[-1]}")
    out_shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {t.shape[0]} targets")
    out = _FusedLogprobs.apply(h, weight, t, float(temperature), int(chunk_size), bool(return_entropy))
    if return_entropy:
        logprobs, entropy = out
        return logprobs.view(out_shape), entropy.view(out_shape)
    return out.view(out_shape), None
