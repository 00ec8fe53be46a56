"""FlashAttention-4's causal attention at the trainer's long-row shapes (Qwen3-0.6B: 16 query heads, 8 KV heads of
128), forward and backward timed apart, four ways:

- ``varlen_gqa``: what the trainer runs (`prime_models.layers.flash_attn4`): one row as a varlen batch, native GQA;
- ``dense_gqa``: the same row as a ``[1, S, H, D]`` batch (FA4's non-varlen kernels);
- ``varlen_mha``: K/V expanded to the 16 query heads before the kernel, dK/dV summed back over each head pair after,
  so FA4's GQA backward (dK/dV accumulated in fp32 by atomics, then converted) becomes its direct-store one;
- ``sdpa_cudnn``: torch SDPA's cuDNN kernel with ``enable_gqa`` (the default without FA4).

Needs a GPU with FA4 staged (`benchmarks/fa4_setup.sh`). ``python3 benchmarks/fa4_gqa_bwd.py --out F.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_ms, kernel_record  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28


def _variants(seq: int):
    import torch
    from flash_attn.cute import interface as fa4

    def tensors(heads_kv: int, dense: bool):
        shape_q, shape_kv = (seq, HEADS, HEAD_DIM), (seq, heads_kv, HEAD_DIM)
        if dense:
            shape_q, shape_kv = (1, *shape_q), (1, *shape_kv)
        g = torch.Generator(device="cuda").manual_seed(0)
        shapes = (shape_q, shape_kv, shape_kv, shape_q)  # q, k, v and the output's gradient
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes]

    scale = HEAD_DIM**-0.5
    cu = torch.tensor([0, seq], device="cuda", dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq, max_seqlen_k=seq)

    def fa4_pair(dense: bool, expand: bool):
        q, k, v, dout = tensors(KV_HEADS, dense)
        extra = {} if dense else varlen

        def kv():
            if not expand:
                return k, v
            return k.repeat_interleave(HEADS // KV_HEADS, dim=-2), v.repeat_interleave(HEADS // KV_HEADS, dim=-2)

        def fwd():
            kk, vv = kv()
            return fa4._flash_attn_fwd(q, kk, vv, softmax_scale=scale, causal=True, return_lse=True, **extra)[:2]

        out, lse = fwd()

        def bwd():
            kk, vv = kv()
            dq, dk, dv = fa4._flash_attn_bwd(q, kk, vv, out, dout, lse, scale, True, **extra)[:3]
            if expand:
                dk = dk.unflatten(-2, (KV_HEADS, -1)).sum(-2)
                dv = dv.unflatten(-2, (KV_HEADS, -1)).sum(-2)
            return dq, dk, dv

        return fwd, bwd

    def sdpa_pair():
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v, dout = (t.transpose(0, 1).unsqueeze(0) for t in tensors(KV_HEADS, False))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def fwd():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        out = fwd()

        def bwd():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        return fwd, bwd

    return {
        "varlen_gqa": lambda: fa4_pair(dense=False, expand=False),
        "dense_gqa": lambda: fa4_pair(dense=True, expand=False),
        "varlen_mha": lambda: fa4_pair(dense=False, expand=True),
        "sdpa_cudnn": sdpa_pair,
    }


def _check_same(seq: int) -> dict:
    """The three FA4 ways give the same gradients (up to bf16 rounding of the sums)."""

    grads = {}
    for name, make in _variants(seq).items():
        if name == "sdpa_cudnn":
            continue
        _, bwd = make()
        grads[name] = [g.float().reshape(seq, -1, HEAD_DIM) for g in bwd()]
    ref = grads["varlen_gqa"]
    return {
        name: max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(gs, ref, strict=True))
        for name, gs in grads.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,65536")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    record = kernel_record(
        "fa4_gqa_bwd",
        args.commit,
        shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, causal=True, dtype="bfloat16"),
        baseline="varlen_gqa (the trainer's FA4 op) and sdpa_cudnn (the default without FA4)",
        rows=[],
        max_rel_grad_diff_vs_varlen_gqa_at_4096=_check_same(4096),
    )
    for seq in (int(s) for s in args.seqs.split(",")):
        flops_fwd = 2 * 2 * seq * seq * HEADS * HEAD_DIM / 2
        for name, make in _variants(seq).items():
            fwd, bwd = make()
            ms_fwd, ms_bwd = cuda_ms(fwd, args.iters), cuda_ms(bwd, args.iters)
            row = dict(seq=seq, way=name, fwd_ms=round(ms_fwd, 3), bwd_ms=round(ms_bwd, 3),
                       fwd_tflops=round(flops_fwd / ms_fwd / 1e9, 1), bwd_tflops=round(2.5 * flops_fwd / ms_bwd / 1e9, 1),
                       step_s_for_28_layers=round(LAYERS * (ms_fwd + ms_bwd) / 1e3, 3))  # fmt: skip
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            del fwd, bwd
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
