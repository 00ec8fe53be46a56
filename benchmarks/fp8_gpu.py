"""FP8 training vs bf16 on one GPU (issue 10, item 3): loss curves, throughput, peak memory.

    python benchmarks/fp8_gpu.py --jobs 0.6b_bf16,0.6b_tensorwise,0.6b_rowwise --out $OUT --commit <sha>
    python benchmarks/fp8_gpu.py --jobs 4b_bf16,4b_tensorwise,4b_rowwise --out $OUT --commit <sha>   # same $OUT
    python benchmarks/fp8_gpu.py --report $OUT/results.json --commit <sha>   # -> benchmarks/results/fp8_gpu.json

A job is `<shape>_<recipe>`: shape `0.6b` (benchmarks/models/qwen3-0.6b) or `4b` (the Qwen3-4B shape: hidden 2560,
36 layers, 32 heads, 8 KV heads, intermediate 9728), recipe `bf16` (no FP8), `tensorwise` or `rowwise`
(`--model.fp8.recipe`). Each job runs in a fresh process: the trainer's own `build_model` (random init, seed 0,
fp32 master weights with bf16 FSDP2 compute unless `--dtype bfloat16`, full activation checkpointing), fused AdamW
(lr 3e-4, no weight decay, clipping at 1.0), `--steps` steps on the same synthetic batches: each row repeats a random
motif (8-64 tokens from a 4096-token slice of the vocabulary), so the loss falls quickly (unigram statistics first,
then copying) and the bf16 and FP8 curves can be compared step by step. Throughput, MFU (against the bf16 peak) and
peak memory come from the steps after `--warmup` (compilation of the quantization kernels happens in the first steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SHAPES = {
    "0.6b": {},
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, head_dim=128),
    # CPU smoke test of this script only (`--device cpu`).
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, head_dim=16, vocab_size=8192),
}  # fmt: skip
RECIPES = ("bf16", "tensorwise", "rowwise")
MOTIF_VOCAB = 4096


def model_dir(shape: str, tmp: Path) -> Path:
    cfg = json.loads((ROOT / "benchmarks/models/qwen3-0.6b/config.json").read_text())
    cfg.update(SHAPES[shape])
    path = tmp / f"qwen3-{shape}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def synthetic_batch(step: int, rows: int, seq_len: int, seed: int = 0):
    """Rows of a repeated random motif; identical for every job (CPU generator), so curves compare step by step."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = torch.empty(rows, seq_len, dtype=torch.long)
    for r in range(rows):
        length = int(torch.randint(8, 65, (1,), generator=g))
        motif = torch.randint(0, MOTIF_VOCAB, (length,), generator=g)
        out[r] = motif.repeat(seq_len // length + 1)[:seq_len]
    return out


def run_one(shape: str, recipe: str, args: argparse.Namespace, out: Path) -> None:
    """One training run in this process; writes its record to `out`."""
    import torch
    from prime_core.config.shared import Fp8Config
    from prime_core.config.trainer import ModelInitConfig, ParallelConfig
    from prime_models.flops import flops_per_token
    from prime_trainer import perf
    from prime_trainer.model import build_model
    from prime_trainer.world import init_world, shutdown_world

    world = init_world(args.device)
    dev = world.device

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    tmp = Path(tempfile.mkdtemp(prefix="prime_fp8_"))
    fp8 = Fp8Config(recipe="none" if recipe == "bf16" else recipe, backend=args.backend)
    model, source = build_model(str(model_dir(shape, tmp)), args.dtype, ModelInitConfig(random=True),
                                ParallelConfig(ac=args.ac), world, seed=0, fp8=fp8)  # fmt: skip
    converted = sum(type(m).__name__.startswith(("Float8", "TELinear")) for m in model.modules())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=dev.type == "cuda")
    rows = args.tokens // args.seq_len
    pos = torch.arange(args.seq_len, device=dev).expand(rows, -1)
    losses, times = [], []
    for step in range(args.steps):
        ids = synthetic_batch(step, rows, args.seq_len).to(dev, non_blocking=True)
        if step == args.warmup:
            perf.reset_peak_memory(dev)
        sync()
        t0 = time.perf_counter()
        lp, _ = model(ids, pos, targets=torch.roll(ids, -1, dims=1), chunk_size=2048, return_entropy=False)
        loss = -lp[:, :-1].float().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        times.append(time.perf_counter() - t0)
        if step % 10 == 0 or step == args.steps - 1:
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            print(f"{shape} {recipe} step {step} loss {losses[-1]:.4f} grad norm {norm.item():.3f} "
                  f"time {times[-1]:.3f}s", flush=True)  # fmt: skip
    measured = times[args.warmup :]
    step_s = sum(measured) / len(measured)
    tokens_per_s = rows * args.seq_len / step_s
    fpt = flops_per_token(source.hf_config, args.seq_len)
    record = {
        "shape": shape,
        "recipe": recipe,
        "backend": args.backend if recipe != "bf16" else None,
        "device": perf.device_name(dev),
        "torch": torch.__version__,
        "seq_len": args.seq_len,
        "tokens_per_step": rows * args.seq_len,
        "dtype": args.dtype,
        "ac": args.ac,
        "fp8_modules": converted,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": perf.mfu(fpt, tokens_per_s, perf.peak_flops(dev, None), 1),
        "peak_memory_gib": perf.peak_memory_gib(dev),
        "losses": losses,
    }
    out.write_text(json.dumps(record, indent=2))
    shutdown_world()


def run_jobs(jobs: list[str], out_dir: Path, budget_s: float, passthrough: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    deadline = time.time() + budget_s
    for name in jobs:
        shape, recipe = name.split("_", 1)
        if shape not in SHAPES or recipe not in RECIPES:
            raise SystemExit(f"unknown job {name!r}: <{'|'.join(SHAPES)}>_<{'|'.join(RECIPES)}>")
        left = deadline - time.time()
        if left < 30:
            print(f"== {name}: skipped (budget spent)", flush=True)
            continue
        job_out = Path(tempfile.gettempdir()) / f"prime_fp8_{name}.json"
        job_out.unlink(missing_ok=True)
        cmd = [PY, __file__, "--run", name, "--job-out", str(job_out), *passthrough]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        res = json.loads(job_out.read_text()) if job_out.exists() else {"shape": shape, "recipe": recipe}
        res.update({"job": name, "rc": rc, "wall_s": round(time.time() - t0, 1)})
        if rc != 0:
            res["log_tail"] = log[-3000:]
        results[name] = res
        print("\n".join(ln for ln in log.splitlines() if " step " in ln or "Error" in ln)[-2000:], flush=True)
        print(f"-> rc={rc} tok/s={res.get('tokens_per_s')} peak={res.get('peak_memory_gib')}", flush=True)
        results_file.write_text(json.dumps(results, indent=2))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def report(results_file: Path, commit: str, dest: Path, filename: str = "fp8_gpu.json") -> dict:
    """benchmarks/results/<filename>: one record per run, and per FP8 run its loss and speed against bf16."""
    results = json.loads(results_file.read_text())
    records, comparisons = [], []
    for name, r in results.items():
        if r.get("tokens_per_s") is None:
            records.append({"job": name, "rc": r.get("rc"), "log_tail": r.get("log_tail", "")[-600:]})
            continue
        records.append({
            "benchmark": "fp8_training", "job": name, "model": f"Qwen3-{r['shape'].upper()} shape (random init)",
            "recipe": r["recipe"], "backend": r.get("backend"), "seq_len": r["seq_len"], "device": r["device"],
            "commit": commit, "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
            "peak_memory_gib": r["peak_memory_gib"], "step_time_s": r["step_time_s"],
            "tokens_per_step": r["tokens_per_step"], "dtype": r["dtype"], "ac": r["ac"],
            "fp8_modules": r["fp8_modules"], "losses": r["losses"],
        })  # fmt: skip
    for name, r in results.items():
        base = results.get(f"{r.get('shape')}_bf16", {})
        if r.get("recipe") == "bf16" or r.get("tokens_per_s") is None or base.get("tokens_per_s") is None:
            continue
        fp8_l, bf16_l = r["losses"], base["losses"]
        # Relative gap per step; the last-5 mean smooths step-to-step noise of the final value.
        gaps = [abs(a - b) / b for a, b in zip(fp8_l, bf16_l, strict=True)]
        final = abs(_mean(fp8_l[-5:]) - _mean(bf16_l[-5:])) / _mean(bf16_l[-5:])
        comparisons.append({
            "job": name, "baseline": f"{r['shape']}_bf16", "final_loss_fp8": _mean(fp8_l[-5:]),
            "final_loss_bf16": _mean(bf16_l[-5:]), "final_loss_rel_diff": final, "max_step_loss_rel_diff": max(gaps),
            "within_2pct": final <= 0.02, "speedup": r["tokens_per_s"] / base["tokens_per_s"],
            "peak_memory_ratio": r["peak_memory_gib"] / base["peak_memory_gib"],
        })  # fmt: skip
    summary = {"benchmark": "fp8_training", "commit": commit, "records": records, "comparisons": comparisons}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / filename).write_text(json.dumps(summary, indent=2) + "\n")
    for c in comparisons:
        print(f"{c['job']}: final loss rel diff {c['final_loss_rel_diff']:.4f} (max step {c['max_step_loss_rel_diff']:.4f})"
              f", speedup {c['speedup']:.3f}x, memory x{c['peak_memory_ratio']:.2f}")  # fmt: skip
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="0.6b_bf16,0.6b_tensorwise,0.6b_rowwise")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--report-name", default="fp8_gpu.json", help="file under benchmarks/results/ that --report writes")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--job-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (rows = tokens / seq-len)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16"], help="master weights: auto = fp32")
    ap.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--backend", default="torch", choices=["auto", "torch", "te"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke-test this script")
    args = ap.parse_args()
    if args.run:
        shape, recipe = args.run.split("_", 1)
        run_one(shape, recipe, args, args.job_out)
    elif args.report:
        report(args.report, args.commit, ROOT / "benchmarks/results", args.report_name)
    else:
        if args.out is None:
            ap.error("--out is required to run jobs")
        passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                       ("steps", "warmup", "seq_len", "tokens", "lr", "dtype", "ac", "backend", "device")]  # fmt: skip
        run_jobs([j for j in args.jobs.split(",") if j], args.out, args.budget_s, passthrough)


if __name__ == "__main__":
    main()
