"""GPU trainer benchmarks (issue 9, items 1-4): prime's `trainer --bench` / `sft --bench` against a transformers +
FSDP2 baseline (benchmarks/baseline_hf.py) on the same device in the same call.

    python benchmarks/trainer_gpu.py --jobs smoke,rl16k,base16k_liger_ac,... --out $OUT --commit <sha>
    python benchmarks/trainer_gpu.py --report results.json --commit <sha>   # -> benchmarks/results/*.json

Model: benchmarks/models/qwen3-0.6b (config only: Qwen3-0.6B shape, random init). Each job is a fresh process
(clean peak memory); jobs run in the order given until `--budget-s` is spent. Besides the end-to-end jobs:
`micro` times SDPA backends (flash, cudnn, efficient) forward+backward at 16k/65k and the fused log-prob head,
`profile<S>` runs the trainer's own `train_step` under torch.profiler and groups CUDA kernel time by kind.
Everything lands in one `results.json` under `--out` (plus `profile_*.txt`); `--report` turns that into
benchmarks/results/trainer_gpu_*.json records, each with its ratio to the matching baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "benchmarks/models/qwen3-0.6b"
PY = sys.executable
H100_PEAK = 989e12


def trainer_cmd(
    process: str, seq: int, extra: list[str], out: Path, steps: int = 5, rows: int = 1, micro_rows: int = 1
) -> list[str]:
    module = "prime_trainer.entrypoints." + ("trainer" if process == "trainer" else "sft")
    return [PY, "-m", module, "--bench", "--model.name", str(MODEL), "--init.random", "--data.fake.batch-size", str(rows),
            "--data.fake.micro-batch-size", str(micro_rows), "--data.fake.seq-len", str(seq), "--seq-len", str(seq),
            "--max-steps", str(steps), "--output-dir", f"/tmp/prime_bench/{out.stem}", "--bench-file", str(out),
            "--log.file", "false", *extra]  # fmt: skip


def baseline_cmd(seq: int, liger: bool, ac: bool, out: Path) -> list[str]:
    cmd = [PY, str(ROOT / "benchmarks/baseline_hf.py"), "--model", str(MODEL), "--seq-len", str(seq), "--out", str(out)]
    return cmd + (["--liger"] if liger else []) + (["--ac"] if ac else [])


def job_spec(name: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """Command and extra env of a named job. Names: rl<K>k[_noac|_sel][_cudnn|_flash][_c<chunk>][_keepattn[N]]
    [_offloadattn][_mlpchunk<N>][_gqa|_expandkv][_nocompile][_b<rows>][_m<rows>][_var], sft<K>k..., base<K>k[_liger][_ac],
    profile<K>k[...], micro.
    `_b<N>` trains N rows of <K>k tokens per step in micro-batches of `_m<M>` rows (default one row of each), and `_var`
    packs random-length samples into each row: `rl2k_noac_b64_m1_var` is the one-GPU RL loop's step (512 rollouts
    packed into 2048-token rows, one row per forward).
    `_mlpchunk<N>` runs each dense MLP in N sequence chunks under full AC (`--parallel.ac-mlp-chunks N`);
    `_offloadattn` (with `_keepattn`) holds the kept attention outputs in pinned host memory between forward and
    backward (`--parallel.ac-offload-attention`)."""
    out = tmp / f"{name}.json"
    env: dict[str, str] = {}
    if name == "micro":
        return [PY, __file__, "--micro", "--out", str(out)], env
    if name == "smoke":
        return trainer_cmd("trainer", 4096, ["--parallel.ac", "full"], out, steps=3), env
    parts = name.split("_")
    head, flags = parts[0], set(parts[1:])
    kind = head.rstrip("0123456789k")
    seq = int(head[len(kind) :].rstrip("k")) * 1024
    for b in ("cudnn", "flash", "efficient"):
        if b in flags:
            env["PRIME_SDPA_BACKENDS"] = b
    if "gqa" in flags:  # native GQA is the default now; the flag stays so older job names still mean the same
        env["PRIME_SDPA_GQA"] = "1"
    if "expandkv" in flags:
        env["PRIME_SDPA_GQA"] = "0"
    if "nocompile" in flags:
        env["PRIME_COMPILE_ELEMENTWISE"] = "0"
    if kind == "base":
        return baseline_cmd(seq, "liger" in flags, "ac" in flags, out), env
    ac = "none" if "noac" in flags else "selective" if "sel" in flags else "full"
    extra = ["--parallel.ac", ac]
    for f in flags:
        if f.startswith("keepattn"):
            extra += ["--parallel.ac-keep-attention", f[len("keepattn") :] or "-1"]
        if f.startswith("mlpchunk") and f[len("mlpchunk") :].isdigit():
            extra += ["--parallel.ac-mlp-chunks", f[len("mlpchunk") :]]
        if f == "offloadattn":
            extra += ["--parallel.ac-offload-attention"]
    for f in flags:
        if f.startswith("c") and f[1:].isdigit():
            extra += ["--init.logprob-chunk-size", f[1:]]
    if "var" in flags:
        extra += ["--data.fake.variable-lengths", "true"]
    shape = {
        "rows": next((int(f[1:]) for f in flags if f.startswith("b") and f[1:].isdigit()), 1),
        "micro_rows": next((int(f[1:]) for f in flags if f.startswith("m") and f[1:].isdigit()), 1),
    }
    if kind == "profile":
        cmd = trainer_cmd("trainer", seq, extra, out, **shape)
        return [PY, __file__, "--profile", "--out", str(out), "--", *cmd[3:]], env
    return trainer_cmd("trainer" if kind == "rl" else "sft", seq, extra, out, **shape), env


def run_jobs(jobs: list[str], out_dir: Path, budget_s: float) -> None:
    tmp = Path("/tmp/prime_bench")
    tmp.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    deadline = time.time() + budget_s
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in jobs:
        left = deadline - time.time()
        if left < 20:
            print(f"== {name}: skipped (budget spent)", flush=True)
            results[name] = {"status": "skipped"}
            continue
        cmd, env = job_spec(name, tmp)
        print(f"== {name}: {' '.join(cmd[1:])} {env}", flush=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env={**base_env, **env}, capture_output=True, text=True, timeout=left)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        wall = time.time() - t0
        res_path = tmp / f"{name}.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        res.update({"job": name, "rc": rc, "wall_s": round(wall, 1), "env": env})
        if rc != 0:
            res["log_tail"] = log[-3000:]
        results[name] = res
        lines = [ln for ln in log.splitlines() if "step " in ln or "Error" in ln or "error" in ln]
        print("\n".join(lines[-8:]), flush=True)
        print(f"-> rc={rc} wall={wall:.0f}s tok/s={res.get('tokens_per_s')} peak={res.get('peak_memory_gib')}",
              flush=True)  # fmt: skip
        if name.startswith("profile") and (tmp / f"{name}.txt").exists():
            (out_dir / f"{name}.txt").write_text((tmp / f"{name}.txt").read_text())
        results_file.write_text(json.dumps(results, indent=2))
        if name == "smoke" and rc != 0:
            print("smoke failed: stopping", flush=True)
            break


# --- in-process modes ---------------------------------------------------------------------------------------------


def _time_cuda(fn, iters: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def micro(out: Path) -> None:
    """Per-layer attention fwd / fwd+bwd per SDPA backend, and the fused head fwd+bwd, at Qwen3-0.6B shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(ROOT / "packages/prime-models/src"))
    from prime_models.fused_head import fused_logprobs

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "attention": {}, "head": {}}
    heads, dim = 16, 128
    for seq in (16384, 65536):
        # Causal attention FLOPs (fwd): 2 matmuls x 2 flops x S^2/2 x D per head.
        fwd_flops = 2 * 2 * seq * seq / 2 * dim * heads
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:  # fmt: skip
            qkv = [torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"]
            grad = torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16)
            try:
                with sdpa_kernel([backend]):

                    def fwd(qkv=qkv):
                        with torch.no_grad():
                            F.scaled_dot_product_attention(*qkv, is_causal=True)

                    def fwd_bwd(qkv=qkv, grad=grad):
                        o = F.scaled_dot_product_attention(*qkv, is_causal=True)
                        torch.autograd.grad(o, qkv, grad)

                    tf, tfb = _time_cuda(fwd), _time_cuda(fwd_bwd)
                res["attention"][f"{name}_{seq}"] = {
                    "fwd_ms": tf * 1e3,
                    "fwd_bwd_ms": tfb * 1e3,
                    "fwd_tflops": fwd_flops / tf / 1e12,
                    "bwd_tflops": 2 * fwd_flops / (tfb - tf) / 1e12,
                    # One RL step with full AC: fwd + recompute fwd + bwd, 28 layers.
                    "step_s_28_layers_full_ac": 28 * (tfb + tf),
                }
            except Exception as e:  # a backend may not support this shape / build
                res["attention"][f"{name}_{seq}"] = {"error": str(e)[:300]}
            print(name, seq, res["attention"][f"{name}_{seq}"], flush=True)
            del qkv, grad
            torch.cuda.empty_cache()
    vocab, hidden = 151936, 1024
    w = (torch.randn(vocab, hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    # GPU check of the compiled head against its eager path (same bf16 inputs): relative error of each output.
    import prime_models.fused_head as fh

    h = torch.randn(4096, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (4096,), device=dev)
    g_lp, g_ent = torch.randn(4096, device=dev), torch.randn(4096, device=dev)
    outs = []
    for compiled in (False, True):
        fh.COMPILE_ON_CUDA = compiled
        h.grad = w.grad = None
        lp, ent = fused_logprobs(h, w, t, temperature=0.8, chunk_size=1024)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        outs.append([lp.detach(), ent.detach(), h.grad.float(), w.grad.float()])
    fh.COMPILE_ON_CUDA = True
    res["head_check_rel_err"] = {
        k: float((a - b).norm() / b.norm())
        for k, a, b in zip(("lp", "ent", "grad_h", "grad_w"), outs[1], outs[0], strict=True)
    }
    print("head check", res["head_check_rel_err"], "addmm fp32:", fh._ADDMM_FP32_OUT, flush=True)
    w.grad = None
    for seq in (16384, 65536):
        for chunk in (1024, 2048, 4096):
            h = torch.randn(seq, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
            t = torch.randint(0, vocab, (seq,), device=dev)

            def head(h=h, t=t, chunk=chunk):
                lp, _ = fused_logprobs(h, w, t, chunk_size=chunk)
                lp.sum().backward()

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            th = _time_cuda(head)
            res["head"][f"{seq}_c{chunk}"] = {
                "fwd_bwd_ms": th * 1e3,
                "tflops": 3 * 2 * seq * vocab * hidden / th / 1e12,
                "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            }
            print("head", seq, chunk, res["head"][f"{seq}_c{chunk}"], flush=True)
            w.grad = None
    out.write_text(json.dumps(res, indent=2))


KINDS = [
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("optimizer", ("adam",)),
    ("nccl", ("nccl",)),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas")),
]


def profile(out: Path, argv: list[str]) -> None:
    """Run the trainer's own setup + train_step; profile one step after warmup; group CUDA kernel time by kind."""
    import torch
    from prime_core.config import parse_cli
    from prime_core.config.trainer import TrainerConfig
    from prime_trainer import common
    from prime_trainer.rl.data import TensorMicroBatch, fake_micro_batches
    from prime_trainer.rl.loss import build_objective
    from prime_trainer.rl.train import train_step

    cfg = parse_cli(TrainerConfig, argv, prog="trainer")
    c = common.setup(cfg, "trainer")
    objective = build_objective(cfg.loss)
    vocab = c.model_source.vocab_size

    tokens = cfg.data.fake.batch_size * (cfg.data.fake.seq_len or cfg.seq_len)

    def one(step: int) -> float:
        _, batches = fake_micro_batches(cfg.data.fake, cfg.seq_len, vocab, step, c.world, cfg.seed)
        mbs = [TensorMicroBatch.from_numpy(mb, c.world.device) for mb in batches]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(c, objective, step, mbs, 1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for s in range(2):
        one(s)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        wall = one(2)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) / 1e6
    by_kind: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, pats in KINDS if any(p in name for p in pats)), "elementwise/other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e6
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]
    lines = [f"step wall {wall:.3f}s, CUDA kernel time {total:.3f}s (idle/launch gap {wall - total:.3f}s)"]
    lines += [f"{k:20s} {v:8.3f}s {100 * v / total:5.1f}%" for k, v in sorted(by_kind.items(), key=lambda x: -x[1])]
    lines += ["", f"{'kernel':100s} {'calls':>6s} {'total ms':>10s}"]
    lines += [f"{e.key[:100]:100s} {e.count:6d} {e.self_device_time_total / 1e3:10.1f}" for e in top]
    text = "\n".join(lines)
    print(text)
    out.with_suffix(".txt").write_text(text)
    out.write_text(json.dumps({"step_wall_s": wall, "kernel_s": total, "by_kind_s": by_kind,
                               "tokens_per_s": tokens / wall}, indent=2))  # fmt: skip


# --- report -------------------------------------------------------------------------------------------------------

PRIME_RL = {16384: {"rl": (11900, 12.5), "sft": (25500, 52.8)}, 65536: {"rl": (10100, 19.6)}}
TARGETS = {16384: (30000, 12.5), 65536: (17000, 20.0)}
ANCHORS = {  # transformers, same H100 (issue 9)
    "base16k": (24500, 42.7), "base64k": None, "base16k_liger_ac": (24100, 11.8),
    "base64k_liger_ac": (12300, 18.4), "base16k_liger": (29600, 40.6),
}  # fmt: skip


def report(results_file: Path, commit: str, dest: Path) -> None:
    """One JSON record per trainer job, with its ratio to the baseline of the same length run in the same call."""
    results = json.loads(results_file.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        if (
            name in ("micro",)
            or name.startswith("profile")
            or r.get("tokens_per_s") is None
            and r.get("status") != "oom"
        ):
            continue
        seq = r.get("seq_len")
        kind = name.split("_")[0].rstrip("0123456789k")
        head = name.split("_")[0]
        k = head[len(kind) :]
        base_name = f"base{k}_liger_ac"
        base = results.get(base_name, {})
        rec = {
            "benchmark": {"rl": "trainer_rl_step", "sft": "trainer_sft_step", "base": r.get("benchmark")}.get(
                kind, name
            ),
            "job": name,
            "model": "Qwen3-0.6B shape (random init)",
            "seq_len": seq,
            "device": r.get("device_name") or r.get("device"),
            "commit": commit,
            "tokens_per_s": r.get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "peak_memory_gib": r.get("peak_memory_gib"),
            "step_time_s": r.get("step_time_s"),
            "env": r.get("env", {}),  # knobs: PRIME_SDPA_GQA, PRIME_SDPA_BACKENDS
        }
        if kind != "base":
            bt = base.get("tokens_per_s")
            rec["baseline"] = {"job": base_name, "tokens_per_s": bt, "peak_memory_gib": base.get("peak_memory_gib")}
            rec["ratio_to_baseline"] = rec["tokens_per_s"] / bt if bt and rec["tokens_per_s"] else None
            ref = PRIME_RL.get(seq, {}).get(kind)
            if ref:
                rec["prime_rl"] = {"tokens_per_s": ref[0], "peak_memory_gib": ref[1]}
            if kind == "rl" and seq in TARGETS:
                t, m = TARGETS[seq]
                rec["target"] = {"tokens_per_s": t, "peak_memory_gib": m,
                                 "met": bool(rec["tokens_per_s"] >= t and rec["peak_memory_gib"] <= m)}  # fmt: skip
        else:
            rec["status"] = r.get("status")
            rec["anchor"] = ANCHORS.get(name)
        (dest / f"trainer_gpu_{name}.json").write_text(json.dumps(rec, indent=2) + "\n")
        print(name, rec["tokens_per_s"], rec["peak_memory_gib"], rec.get("ratio_to_baseline"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--report", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.micro:
        micro(args.out)
    elif args.profile:
        profile(args.out, args.rest)
    elif args.report:
        report(args.report, args.commit, ROOT / "benchmarks/results")
    else:
        run_jobs([j for j in args.jobs.split(",") if j], args.out, args.budget_s)


if __name__ == "__main__":
    main()
