"""Weight-gradient accumulation on one GPU: what `prime_models.parallel.main_grad` replaces (issue 43).

    python benchmarks/wgrad_accumulate_gpu.py --out $OUT/wgrad.json [--commit <sha>]

For every weight-gradient matmul of a Qwen3-0.6B decoder stack (28 layers: q, k, v, o, gate, up, down) and for the
151,936 x 1024 LM head, at 2048 tokens (one row a forward) and 16,384 (eight rows), it times the three ways a
micro-batch's gradient can reach an fp32 master gradient: a bf16 matmul then an fp32 += bf16 add (the hook path),
the bf16 matmul alone (the floor of that path), and one `addmm` with an fp32 output accumulating in place (main_grad).
It also reports each way's error against a float64 reference. Needs CUDA (`addmm(..., out_dtype=float32)`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_ms  # noqa: E402
from provenance import tree_commit  # noqa: E402

HIDDEN, INTERMEDIATE, Q_WIDTH, KV_WIDTH, LAYERS, VOCAB = 1024, 3072, 2048, 1024, 28, 151936
LAYER_WEIGHTS = [
    (Q_WIDTH, HIDDEN), (KV_WIDTH, HIDDEN), (KV_WIDTH, HIDDEN), (HIDDEN, Q_WIDTH),
    (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE),
]  # fmt: skip


def _ways(shapes: list[tuple[int, int]], tokens: int) -> dict[str, float]:
    grads = [torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16) for o, _ in shapes]
    inputs = [torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16) for _, i in shapes]
    mains = [torch.zeros(o, i, device="cuda") for o, i in shapes]
    triples = list(zip(grads, inputs, mains, strict=True))

    def matmul_then_add():
        for g, x, m in triples:
            m.add_(g.T @ x)

    def matmul_only():
        for g, x, _ in triples:
            g.T @ x

    def addmm_fp32_out():
        for g, x, m in triples:
            torch.addmm(m, g.T, x, out_dtype=torch.float32, out=m)

    return {
        "bf16_matmul_then_fp32_add_ms": cuda_ms(matmul_then_add, 5),
        "bf16_matmul_only_ms": cuda_ms(matmul_only, 5),
        "addmm_fp32_out_in_place_ms": cuda_ms(addmm_fp32_out, 5),
    }


def _errors(tokens: int) -> dict[str, float]:
    g = torch.randn(tokens, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    exact = g.T.double() @ x.double()
    fused = torch.zeros(INTERMEDIATE, HIDDEN, device="cuda")
    torch.addmm(fused, g.T, x, out_dtype=torch.float32, out=fused)
    rel = lambda a: float((a.double() - exact).abs().max() / exact.abs().max())  # noqa: E731
    return {"addmm_fp32_out_max_rel_error": rel(fused), "bf16_matmul_max_rel_error": rel(g.T @ x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_accumulate_gpu: needs a CUDA GPU")
    result = {
        "benchmark": "wgrad_accumulate_gpu", "device": torch.cuda.get_device_name(), "commit": tree_commit(args.commit),
        "vocab_size": VOCAB, "torch": torch.__version__, "tokens": {},
    }  # fmt: skip
    for tokens in (2048, 16384):
        result["tokens"][tokens] = {
            "decoder_stack": _ways(LAYER_WEIGHTS * LAYERS, tokens),
            "lm_head": _ways([(VOCAB, HIDDEN)], tokens),
            **_errors(tokens),
        }
        torch.cuda.empty_cache()
        print(tokens, json.dumps(result["tokens"][tokens]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
