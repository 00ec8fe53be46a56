"""FlashAttention-4's Hopper tile configurations at the trainer's long-row shape (Qwen3-0.6B: 16 query heads, 8 KV
heads of 128, causal, one varlen row), each timed and checked against FA4's own choice.

FA4 picks one backward configuration per head dim on sm90 (`_tile_size_bwd_sm90`, taken from FA3's C++ launch
template, tuned on an H100 at shorter rows) and one forward configuration (`_tile_size_fwd_sm90`). At 64k tokens
the backward alone is ~2 s of the trainer's 3.3 s step (issue 43), so this sweeps the configurations the kernel
accepts: each one replaces FA4's table for the call, the kernel is compiled afresh, its gradients (or output) are
compared with the default configuration's, and forward or backward is timed with CUDA events. A configuration the
kernel refuses (registers, shared memory, a layout it does not implement) is recorded with its error's first line.

Needs a GPU with FA4 staged (`benchmarks/fa4_setup.sh`):
``python3 benchmarks/fa4_tiles.py --seqs 65536 --out F.json [--configs default,m80_dqswap] [--budget-s 420]``. The record is rewritten after every
configuration, so a call cut short still returns what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import cuda_ms, kernel_record  # noqa: E402
from fa4_gqa_bwd import HEAD_DIM, HEADS, LAYERS, _variants  # noqa: E402

_BWD_DEFAULT = dict(
    m_block_size=64, n_block_size=128, num_stages_Q=2, num_stages_dO=2, num_stages_PdS=2, SdP_swapAB=True,
    dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1, num_wg=2,
    dQ_single_wg=False,
)  # fmt: skip
"""FA4's sm90 backward choice for head dim 128, causal (as of upstream 0251105a); every candidate changes some of it."""

BWD_CANDIDATES: dict[str, dict] = {
    "default": {},
    "pds1": dict(num_stages_PdS=1),
    "m80_dqswap": dict(m_block_size=80, dQ_swapAB=True),
    "m96_dqswap": dict(m_block_size=96, dQ_swapAB=True),
    "n96": dict(n_block_size=96),
    "n112": dict(n_block_size=112),
    "n144": dict(n_block_size=144),
    "n160_pds1": dict(n_block_size=160, num_stages_PdS=1),
    "ndkv1": dict(AtomLayoutNdKV=1),
    "mdq2": dict(AtomLayoutMdQ=2),
    "dq_single_wg": dict(dQ_single_wg=True),
    "sdp_noswap_msdp2": dict(SdP_swapAB=False, AtomLayoutMSdP=2),
    "m128_msdp2": dict(m_block_size=128, AtomLayoutMSdP=2, num_stages_Q=1, num_stages_dO=1),
    "wg3_n192": dict(n_block_size=192, num_wg=3, AtomLayoutNdKV=3, num_stages_PdS=1),
    "q1_do1_n160": dict(n_block_size=160, num_stages_Q=1, num_stages_dO=1),
}

FWD_CANDIDATES: dict[str, tuple] = {
    "default": (128, 128, True, True),
    "n112": (128, 112, True, True),
    "n144": (128, 144, True, True),
    "n160": (128, 160, True, True),
    "n176": (128, 176, True, True),
    "n128_nors": (128, 128, False, True),
    "m192_n112_nors": (192, 112, False, True),
}


def _rel_diff(got, ref) -> float:
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref, strict=True)
    )


def _sweep(kind: str, seq: int, iters: int, deadline: float, record: dict, save, only: set[str]) -> None:
    from flash_attn.cute import interface as fa4

    fwd, bwd = _variants(seq)["varlen_gqa"]()
    table = "_tile_size_bwd_sm90" if kind == "bwd" else "_tile_size_fwd_sm90"
    original, cache = getattr(fa4, table), (fa4._flash_attn_bwd if kind == "bwd" else fa4._flash_attn_fwd).compile_cache
    fn = bwd if kind == "bwd" else fwd
    flops = 2 * 2 * seq * seq * HEADS * HEAD_DIM / 2 * (2.5 if kind == "bwd" else 1.0)
    ref = None
    for name, change in (BWD_CANDIDATES if kind == "bwd" else FWD_CANDIDATES).items():
        if only and name not in only:
            continue
        if time.monotonic() > deadline:
            record["rows"].append(dict(kind=kind, seq=seq, config=name, skipped="budget spent"))
            continue
        cfg = fa4.BwdConfig(**{**_BWD_DEFAULT, **change}) if kind == "bwd" else fa4.FwdConfig(*change)
        setattr(fa4, table, lambda *a, cfg=cfg, **k: cfg)
        cache.clear()
        row = dict(kind=kind, seq=seq, config=name, change=change if kind == "bwd" else list(change))
        try:
            t0 = time.monotonic()
            out = [t for t in fn() if t is not None]
            row["compile_and_first_call_s"] = round(time.monotonic() - t0, 1)
            ref = out if ref is None else ref
            row["max_rel_diff_vs_default"] = _rel_diff(out, ref)
            ms = cuda_ms(fn, iters)
            row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), step_s_28_layers=round(LAYERS * ms / 1e3, 3))
        except Exception as e:  # noqa: BLE001 - a configuration the kernel refuses is a result, not a failure
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        finally:
            setattr(fa4, table, original)
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="65536", help="row lengths, comma-separated")
    ap.add_argument("--configs", default="", help="only these candidates (comma-separated names; 'default' first)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kinds", default="bwd,fwd", help="bwd, fwd or both, in the order given")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new configuration is started after this")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    record = kernel_record(
        "fa4_tiles",
        args.commit,
        shape=dict(heads=HEADS, kv_heads=8, head_dim=HEAD_DIM, causal=True, dtype="bfloat16", varlen_rows=1),
        baseline="FA4's own sm90 configuration (row 'default' of each kind)",
        rows=[],
    )

    def save() -> None:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, args.out)

    deadline = time.monotonic() + args.budget_s
    only = {c for c in args.configs.split(",") if c}
    for seq in (int(s) for s in args.seqs.split(",")):
        for kind in args.kinds.split(","):
            _sweep(kind, seq, args.iters, deadline, record, save, only)
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
